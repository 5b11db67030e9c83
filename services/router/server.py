"""Around the request path: the router process, the Orchestrator (its core) behind every registered front door
(frontends/: gRPC services on the router's port, listeners of their own such as OpenAI-compatible HTTP), all on one
event loop; health, discovery and the drain."""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import grpc

from common.discovery import Discovery
from common.telemetry.metrics import Metrics
from services.kit.observability import Observability
from services.router.config import RouterConfig
from services.router import frontends, policies
from services.router.kv_index import KvIndex
from services.router.orchestrator import Orchestrator
from services.router.prepare import RequestPreparer
from services.router.warm_up import WarmUp, warm_up
from services.router.workers import WorkerPool
from services.kit.grpc_auth import api_key_interceptors
from services.kit.ports import advertised_host
from common.heap import settle_heap
from services.kit.serving import Server, start_server, wait_for_signal
from services.kit.wire import ParseRequests

log = logging.getLogger(__name__)

_HEALTH_POLL_S = 0.1
_DRAIN_POLL_S = 0.05
_END_GRACE_S = 5.0  # past --drain-timeout: for the ended requests to send their status


async def serve(config: RouterConfig, discovery: Discovery, obs: Observability | None = None) -> None:
    """Load the tokenizer, follow the workers, serve until SIGINT/SIGTERM, then drain."""
    preparer = await asyncio.to_thread(RequestPreparer.from_model_dir, config.model)
    pool = worker_pool(config, discovery)
    orchestrator = Orchestrator(pool, preparer, config, obs.metrics if obs is not None else None)
    doors = frontends.doors()
    health_methods = [method for door in doors for method in door.health_methods]
    server = await start_server(lambda s: _add_grpc_front_doors(s, doors, orchestrator),
                                [name for door in doors for name in door.grpc_services], config.host, config.port,
                                interceptors=[*api_key_interceptors(config.api_keys, health_methods), ParseRequests()],
                                reuse_port=config.reuse_port)
    try:
        listeners = await _start_listeners(doors, orchestrator, config, obs.metrics if obs is not None else None)
    except BaseException:  # a port taken: stop the gRPC server too, or its threads keep the process alive
        await server.server.stop(0)
        raise
    settle_heap(obs.metrics if obs is not None else None)  # (the tokenizer is loaded; no request is served yet)
    await pool.start()
    advertised = advertised_host(config.host, config.advertise_host)
    banners = [listener.banner(advertised) for listener in listeners]
    health = asyncio.create_task(_track_health(server, orchestrator, f"{advertised}:{server.port}", banners,
                                               lambda: warm_up(pool, preparer, config)))
    try:
        if obs is not None:
            await obs.start(config.host, advertised, server.port)
        await wait_for_signal()
        if obs is not None:
            await obs.deregister()  # out of Consul first: no new requests while draining
        log.info("draining %d requests (up to %gs)", orchestrator.inflight, config.drain_timeout_s)
        orchestrator.draining = True  # new requests on every front door: UNAVAILABLE (HTTP 503)
        health.cancel()
        await server.stop(grace_s=1.0, drain=lambda: _drain(orchestrator, config.drain_timeout_s,
                                                            f"{advertised}:{server.port}"))
    finally:
        for listener in listeners:
            await listener.stop()
        await server.server.stop(0)  # stopped already, unless serving failed (a --metrics-port taken)
        health.cancel()
        await pool.close()
        await discovery.close()
        await orchestrator.close()
        if obs is not None:
            await obs.stop()  # the drain's spans are flushed too


def worker_pool(config: RouterConfig, discovery: Discovery) -> WorkerPool:
    """The router's workers; it follows their KV events only when its policy needs the KV index."""
    needs_kv_index = policies.factory_of(config.policy).needs_kv_index
    return WorkerPool(discovery, contact_timeout_s=config.worker_wait_s,
                      kv_index=KvIndex() if needs_kv_index else None)


def _add_grpc_front_doors(server: grpc.aio.Server, doors: list[frontends.FrontDoor],
                          orchestrator: Orchestrator) -> None:
    for door in doors:
        if door.add_to_server is not None:
            door.add_to_server(server, orchestrator)


async def _start_listeners(doors: list[frontends.FrontDoor], orchestrator: Orchestrator, config: RouterConfig,
                           metrics: Metrics | None) -> list[frontends.Listener]:
    """The front doors' own listeners (those the config turns on); when one fails, those started are stopped."""
    listeners: list[frontends.Listener] = []
    try:
        for door in doors:
            listener = await door.start(orchestrator, config, metrics) if door.start is not None else None
            if listener is not None:
                listeners.append(listener)
    except BaseException:
        for listener in listeners:
            await listener.stop()
        raise
    return listeners


async def _track_health(server: Server, orchestrator: Orchestrator, endpoint: str, banners: list[str],
                        warm: Callable[[], Awaitable[WarmUp]]) -> None:
    """SERVING while every discovered worker has been heard from and a decode worker is ready; the first time,
    only once `warm`'s requests (warm_up.py) have run."""
    serving: bool | None = None
    announced = False
    warmed: WarmUp | None = None
    while True:
        ready = orchestrator.ready()
        if ready and not announced:
            warmed = await warm()
            ready = orchestrator.ready()
        if ready != serving:
            await server.set_serving(ready)
            log.info("health: %s", "SERVING" if ready else "NOT_SERVING")
            serving = ready
        if ready and not announced:
            for banner in banners:
                print(f"disagg-router {banner}", flush=True)
            print(f"disagg-router serving on {endpoint} ({warmed.note()})", flush=True)
            announced = True
        await asyncio.sleep(_HEALTH_POLL_S)


async def _drain(orchestrator: Orchestrator, timeout_s: float, endpoint: str) -> None:
    """Until the requests in flight have finished; past `timeout_s` they end with UNAVAILABLE naming the drain."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while orchestrator.inflight and loop.time() < deadline:
        await asyncio.sleep(_DRAIN_POLL_S)
    if orchestrator.inflight:
        log.warning("--drain-timeout %gs passed with %d requests in flight; ending them", timeout_s,
                    orchestrator.inflight)
        orchestrator.end_inflight(f"router {endpoint} draining: --drain-timeout {timeout_s:g}s passed; "
                                  "retry the request")
        while orchestrator.inflight and loop.time() < deadline + _END_GRACE_S:
            await asyncio.sleep(_DRAIN_POLL_S)

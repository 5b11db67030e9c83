"""The router's gRPC front door (disagg.v1.Generation): a thin servicer over the Orchestrator."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from typing import AsyncIterator

import grpc

from common.discovery import Discovery, Role
from common.errors import DisaggError
from common.pb.disagg.v1 import generation_pb2, generation_pb2_grpc
from services.router.config import RouterConfig
from services.router.kv_index import KvIndex
from services.router.multiplex import Multiplexer
from services.router.orchestrator import Orchestrator
from services.router.prepare import RequestPreparer
from services.router.workers import WorkerPool
from services.observability import Observability
from services.serving import Server, abort_with, start_server, status_of, wait_for_signal
from services.wire import ParseRequests

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_HEALTH_POLL_S = 0.1


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, orchestrator: Orchestrator):
        self._orchestrator = orchestrator

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        out = self._orchestrator.response(request.request_id or uuid.uuid4().hex)
        try:
            responses = self._orchestrator.generate(request, out, context.time_remaining())
            async with contextlib.aclosing(responses) as responses:
                async for response in responses:
                    await context.write(response)
        except asyncio.CancelledError:
            out.close(grpc.StatusCode.CANCELLED)  # the client went away
            raise
        except Exception as exc:
            out.close(status_of(exc))
            await abort_with(context, exc)

    async def GenerateStream(self, request_iterator: AsyncIterator[generation_pb2.GenerateStreamRequest],
                             context: grpc.aio.ServicerContext) -> None:
        try:
            await Multiplexer(self._orchestrator).serve(request_iterator, context)
        except DisaggError as exc:
            await abort_with(context, exc)

    async def ListModels(self, request: generation_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> generation_pb2.ListModelsResponse:
        try:
            model = self._orchestrator.served_model()
        except DisaggError as exc:
            await abort_with(context, exc)
        return generation_pb2.ListModelsResponse(
            models=[generation_pb2.ModelInfo(id=model.name, max_model_len=model.max_model_len)])


async def serve(config: RouterConfig, discovery: Discovery, obs: Observability | None = None) -> None:
    """Load the tokenizer, follow the workers, serve until SIGINT/SIGTERM, then drain."""
    preparer = await asyncio.to_thread(RequestPreparer.from_model_dir, config.model)
    pool = WorkerPool(discovery, contact_timeout_s=config.worker_wait_s,
                      kv_index=KvIndex() if config.policy == "kv_aware" else None)
    orchestrator = Orchestrator(pool, preparer, config, obs.metrics if obs is not None else None)
    server = await start_server(
        lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(orchestrator), s),
        [SERVICE_NAME], config.host, config.port, interceptors=[ParseRequests()])
    await pool.start()
    advertised = os.environ.get("DISAGG_ADVERTISE_HOST") or (
        socket.gethostname() if config.host in ("0.0.0.0", "::", "") else config.host)
    health = asyncio.create_task(_track_health(server, pool, orchestrator, f"{advertised}:{server.port}"))
    try:
        if obs is not None:
            await obs.start(config.host, advertised, server.port)
        await wait_for_signal()
        if obs is not None:
            await obs.stop()  # out of Consul first: no new requests while draining
        log.info("draining %d requests (up to %.0fs)", orchestrator.inflight, config.drain_timeout_s)
        orchestrator.draining = True
        health.cancel()
        await server.stop(grace_s=1.0, drain=lambda: _drain(orchestrator, config.drain_timeout_s))
    finally:
        health.cancel()
        await pool.close()
        await discovery.close()
        await orchestrator.close()


async def _track_health(server: Server, pool: WorkerPool, orchestrator: Orchestrator, endpoint: str) -> None:
    """SERVING while every discovered worker has been heard from and a decode worker is ready."""
    serving: bool | None = None
    announced = False
    while True:
        ready = pool.settled and bool(pool.ready(Role.DECODE)) and not orchestrator.draining
        if ready != serving:
            await server.set_serving(ready)
            log.info("health: %s", "SERVING" if ready else "NOT_SERVING")
            serving = ready
        if ready and not announced:
            print(f"disagg-router serving on {endpoint}", flush=True)
            announced = True
        await asyncio.sleep(_HEALTH_POLL_S)


async def _drain(orchestrator: Orchestrator, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while orchestrator.inflight and loop.time() < deadline:
        await asyncio.sleep(0.05)

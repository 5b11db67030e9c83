"""What every engine worker (prefill, decode) shares: its state, the Worker servicer, and the process lifecycle.

Lifecycle: start the gRPC server (health NOT_SERVING), load the engine off the event loop,
flip to SERVING and print `disagg-<role> serving on HOST:PORT`; on SIGTERM/SIGINT go
NOT_SERVING, stop accepting, abort in-flight requests, release sessions, stop the engine.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from typing import Awaitable, Callable, Coroutine

import grpc

from common.engine.config import EngineConfig
from common.engine.default_model import model_label
from common.engine.interface import Engine, EngineLoad, start_engine
from common.engine.request import SamplingParams
from common.errors import DisaggError, InvalidConfig, Unavailable
from common.kv.backends import BACKENDS, PREFERENCE, parse_backends
from common.kv.layout import KvLayout
from common.kv.sharing import KvCacheExporter
from common.telemetry.metrics import Metrics, observe_engine_load
from common.tls import add_tls_args, tls_from_args
from common.tls import configure as configure_tls
from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.convert import kv_event_to_proto
from services.engine_flags import add_engine_args, engine_config_from_args
from services.serving import DEFAULT_MAX_MESSAGE_BYTES, Server, abort_with, setup_logging, start_server
from services.wire import ParseRequests
from services.observability import Observability, add_observability_args
from services.tensor_store import KvSessionSource, TensorSource

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0
_ROLE_NAMES = {worker_pb2.WORKER_ROLE_PREFILL: "prefill", worker_pb2.WORKER_ROLE_DECODE: "decode"}


@dataclass
class WorkerState:
    """What a worker's servicers share: identity, the engine once loaded, and work that outlives an RPC."""

    role: int
    model_name: str
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    endpoint: str = ""  # advertised host:port, known once the server is bound
    engine: Engine | None = None
    kv_layout: KvLayout | None = None
    tensor_source: TensorSource | None = None
    shutting_down: bool = False
    metrics: Metrics | None = None
    worker_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    kv_transfer_backends: tuple[str, ...] = PREFERENCE  # offered (prefill) or accepted (decode)
    kv_exporter: KvCacheExporter | None = None  # prefill: the cache shared with importers
    _tasks: set[asyncio.Task] = field(default_factory=set)

    @property
    def role_name(self) -> str:
        return _ROLE_NAMES[self.role]

    def require_engine(self) -> Engine:
        if self.shutting_down:
            raise Unavailable(f"the {self.role_name} worker is shutting down")
        if self.engine is None:
            raise Unavailable(f"the {self.role_name} worker is still loading its model")
        return self.engine

    def spawn(self, coro: Coroutine) -> None:
        """Run cleanup that must finish even when the RPC that started it is gone; drained at shutdown."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, state: WorkerState):
        self.state = state

    async def GetInfo(self, request, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        try:
            facts = await self.state.require_engine().facts()
        except DisaggError as exc:
            await abort_with(context, exc)
        layout, max_model_len, config = facts.kv_layout, facts.max_model_len, facts.config
        supports_images = facts.image_token_id is not None
        return worker_pb2.WorkerInfo(
            role=self.state.role, model=self.state.model_name, fingerprint=layout.fingerprint,
            block_size=layout.block_size, num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim, dtype=layout.dtype, max_model_len=max_model_len,
            limits=_limits(config, self.state.max_message_bytes), worker_id=self.state.worker_id,
            endpoint=self.state.endpoint, engine=facts.name, engine_version=_version(),
            transfer_backends=self._transfer_backends(), supports_images=supports_images,
        )

    def _transfer_backends(self) -> list[int]:
        exporter = self.state.kv_exporter
        names = exporter.offered if exporter is not None else self.state.kv_transfer_backends
        return [BACKENDS[name] for name in names]

    async def GetLoad(self, request, context: grpc.aio.ServicerContext) -> worker_pb2.Load:
        try:
            load = _load_proto(await self.state.require_engine().load())
            load.stored_tensors, load.stored_tensor_bytes = await self.state.tensor_source.stored()
        except DisaggError as exc:
            await abort_with(context, exc)
        load.timestamp_unix_ms = int(time.time() * 1000)
        return load

    async def SubscribeKvEvents(self, request, context: grpc.aio.ServicerContext):
        """A snapshot of the prefix cache, then live events, numbered per subscription (a gap: resubscribe)."""
        try:
            engine = self.state.require_engine()
        except DisaggError as exc:
            await abort_with(context, exc)
        loop = asyncio.get_running_loop()
        subscriber = await engine.subscribe_kv_events(loop)
        if subscriber is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker runs without a prefix cache "
                                "(--no-prefix-caching), so it has no KV events")
        try:
            while True:
                sequence, body = await subscriber.queue.get()
                yield kv_event_to_proto(sequence, body, self.state.worker_id)
        finally:
            engine.unsubscribe_kv_events(subscriber)


def _limits(config: EngineConfig, max_message_bytes: int) -> worker_pb2.WorkerLimits:
    return worker_pb2.WorkerLimits(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_waiting_requests=config.max_waiting, max_message_bytes=max_message_bytes,
        max_top_logprobs=SamplingParams.MAX_TOP_LOGPROBS, session_ttl_ms=int(config.session_ttl_s * 1000),
    )


def _load_proto(load: EngineLoad) -> worker_pb2.Load:
    return worker_pb2.Load(
        running_requests=load.running, waiting_requests=load.waiting, kv_blocks_total=load.kv_blocks_total,
        kv_blocks_free=load.kv_blocks_free, kv_usage_ratio=load.kv_usage_ratio,
        active_kv_sessions=load.active_sessions, expired_kv_sessions=load.expired_sessions,
    )


def _version() -> str:
    try:
        return metadata.version("disagg")
    except metadata.PackageNotFoundError:
        return "unknown"


# --- the process ---

@dataclass(frozen=True)
class RoleSpec:
    """One worker kind: its role, the services it adds besides Worker, and how to add them."""

    role: int
    service_names: list[str]
    add_servicers: Callable[[grpc.aio.Server, WorkerState, argparse.Namespace], None]
    add_args: Callable[[argparse.ArgumentParser], None] = lambda parser: None


def run_worker(spec: RoleSpec, argv: list[str] | None) -> int:
    name = _ROLE_NAMES[spec.role]
    parser = argparse.ArgumentParser(prog=f"disagg {name}", description=f"The {name} worker.")
    _add_process_args(parser)
    spec.add_args(parser)
    add_engine_args(parser)
    add_tls_args(parser)
    add_observability_args(parser)
    args = parser.parse_args(argv)
    setup_logging(name, args.log_level)
    try:
        config = engine_config_from_args(args)
        args.kv_transfer_backends = parse_backends(args.kv_transfer_backends)
        configure_tls(tls_from_args(args))
    except (InvalidConfig, ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    try:
        asyncio.run(_serve(spec, args, config))
    except Exception:
        log.exception("the %s worker failed", name)
        return 1
    return 0


def _add_process_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    g.add_argument("--advertise-host", default=os.environ.get("DISAGG_ADVERTISE_HOST"),
                   help="host other processes use to reach this one (default: --host, or the hostname for 0.0.0.0)")
    g.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    g.add_argument("--model-name", default=None, help="model name reported to the router (default: from --model)")
    g.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    g.add_argument("--kv-transfer-backends", default=os.environ.get("DISAGG_KV_TRANSFER_BACKENDS", "auto"),
                   help="KV transfer backends this worker offers (prefill) or accepts (decode), best first: "
                        "'auto' or a subset of cuda_ipc,nixl,shm,grpc (grpc is always kept as the fallback)")


def _advertised(args: argparse.Namespace, port: int) -> str:
    host = args.advertise_host or (socket.gethostname() if args.host in ("0.0.0.0", "::", "") else args.host)
    return f"{host}:{port}"


def _model_name(args: argparse.Namespace) -> str:
    return args.model_name or model_label(args.model)


async def _serve(spec: RoleSpec, args: argparse.Namespace, config: EngineConfig) -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    state = WorkerState(spec.role, _model_name(args), args.max_message_bytes,
                        kv_transfer_backends=args.kv_transfer_backends)
    obs = Observability.from_args(state.role_name, state.model_name, args)  # before the server: tracing
    state.metrics = obs.metrics

    def add_servicers(server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(state), server)
        spec.add_servicers(server, state, args)

    names = [*spec.service_names, worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name]
    server = await start_server(add_servicers, names, args.host, args.port, args.max_message_bytes,
                                interceptors=[ParseRequests()])
    state.endpoint = _advertised(args, server.port)
    try:
        if await _load_engine(state, config, stop):
            await server.set_serving(True)
            print(f"disagg-{state.role_name} serving on {state.endpoint}", flush=True)
            log.info("serving %s (%s) as worker %s", state.model_name, config.dtype, state.worker_id)
            layout = state.kv_layout
            await obs.start(args.host, state.endpoint.rpartition(":")[0], server.port,
                            meta={"fingerprint": layout.fingerprint, "block_size": str(layout.block_size),
                                  "worker_id": state.worker_id, "dtype": layout.dtype})
            state.spawn(_publish_load(state, stop))
            await stop.wait()
    finally:
        await obs.stop()
        await _shutdown(server, state)


async def _publish_load(state: WorkerState, stop: asyncio.Event, every_s: float = 1.0) -> None:
    """Keep the engine gauges (running, waiting, KV usage, sessions) fresh for Prometheus scrapes."""
    while not stop.is_set():
        observe_engine_load(state.metrics, _load_proto(await state.engine.load()))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)  # returns at once on shutdown


async def _load_engine(state: WorkerState, config: EngineConfig, stop: asyncio.Event) -> bool:
    """Load the model in a thread; False if a signal came first (the load finishes, unused)."""
    loading = asyncio.ensure_future(asyncio.to_thread(start_engine, config))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not loading.done():
        return False
    engine = loading.result()
    state.kv_layout, kv_cache = (await engine.facts()).kv_layout, await engine.kv_cache()
    if state.role == worker_pb2.WORKER_ROLE_PREFILL:
        state.kv_exporter = KvCacheExporter(kv_cache, state.kv_transfer_backends, state.worker_id)
        state.closers.append(_closer(state.kv_exporter))
    state.engine, state.tensor_source = engine, KvSessionSource(engine, state.kv_layout, state.kv_exporter)
    return True


def _closer(exporter: KvCacheExporter) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        exporter.close()
    return close


async def _shutdown(server: Server, state: WorkerState) -> None:
    state.shutting_down = True
    await server.set_serving(False)
    stopping = asyncio.ensure_future(server.server.stop(SHUTDOWN_GRACE_S))  # refuses new RPCs at once
    engine = state.engine
    running = await engine.abort_all() if engine is not None else 0
    await stopping
    await state.drain(SHUTDOWN_GRACE_S)
    for close in state.closers:
        await close()
    if engine is not None:
        released = await engine.release_all_sessions()
        await asyncio.to_thread(engine.shutdown)
        log.info("stopped: aborted %d requests, released %d KV sessions", running, released)

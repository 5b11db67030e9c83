"""What every worker (encode, prefill, decode) shares: its state and the Worker servicer; and the role
spec of the engine workers (prefill, decode). The process itself is services.worker.shell.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import time
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from typing import Awaitable, Callable, Coroutine, Protocol

import grpc

from common.engine.config import EngineConfig
from common.engine.interface import Engine, EngineLoad
from common.engine.request import SamplingParams
from common.engine.start import start_engine
from common.errors import DisaggError, Unavailable
from common.kv.layout import KvLayout
from common.kv.offer import PREFERENCE, parse_transports
from common.kv.paths import KvPath, open_path
from common.telemetry.metrics import Metrics, observe_engine_load, observe_engine_step, observe_grammar_compile
from common.pb.disagg.v1 import worker_pb2, worker_pb2_grpc
from services.kit.convert import kv_event_to_proto
from services.worker.engine_flags import add_engine_args, effective_engine_json, engine_config_from_args
from services.worker.handoff_flags import add_transport_args
from services.kit.drain import Admission
from services.kit.serving import DEFAULT_MAX_MESSAGE_BYTES, abort_with
from services.worker.tensor_store import TensorSource

log = logging.getLogger(__name__)
ROLE_NAMES = {worker_pb2.WORKER_ROLE_PREFILL: "prefill", worker_pb2.WORKER_ROLE_DECODE: "decode",
              worker_pb2.WORKER_ROLE_ENCODE: "encode"}


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
    admission: Admission = field(default_factory=Admission)  # new requests, until the drain starts
    stopped: str = ""  # why requests in flight were ended (the drain ran out of time); "" while they may run
    metrics: Metrics | None = None
    worker_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    kv_transports: tuple[str, ...] = PREFERENCE  # offered (prefill) or accepted (decode)
    kv_path: KvPath | None = None  # how its sessions' KV moves (common.kv.paths), known once the engine is loaded
    engine_config_json: str = ""  # the effective engine settings (WorkerInfo.engine_config_json)
    _tasks: set[asyncio.Task] = field(default_factory=set)

    @property
    def role_name(self) -> str:
        return ROLE_NAMES[self.role]

    def require_engine(self) -> Engine:
        if self.stopped:
            raise Unavailable(self.stopped)
        if self.engine is None:
            raise Unavailable(f"the {self.role_name} worker is still loading its model")
        return self.engine

    def admit(self) -> Engine:
        """The engine for a new request; Unavailable while loading, and once the drain has started."""
        self.admission.check()
        return self.require_engine()

    def ended(self) -> Unavailable:
        """What a request the engine aborted ends with (only the end of a drain aborts them all)."""
        return Unavailable(self.stopped or f"the {self.role_name} worker aborted the request")

    def spawn(self, coro: Coroutine) -> None:
        """Run cleanup that must finish even when the RPC that started it is gone; drained at shutdown."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)


class WorkerRoleAnswers(Protocol):
    """How one role answers Worker/GetInfo and Worker/GetLoad; DisaggErrors become statuses."""

    no_kv_events: str  # why this role publishes no KV events; "" when it does (from its engine)

    async def info(self, state: WorkerState) -> worker_pb2.WorkerInfo:
        """The role's facts; the servicer fills in identity (role, model, worker id, endpoint, version)."""

    async def load_report(self, state: WorkerState) -> worker_pb2.Load: ...


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, state: WorkerState, answers: WorkerRoleAnswers):
        self.state = state
        self.answers = answers

    async def GetInfo(self, request, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        try:
            info = await self.answers.info(self.state)
        except DisaggError as exc:
            await abort_with(context, exc)
        info.MergeFrom(worker_pb2.WorkerInfo(
            role=self.state.role, model=self.state.model_name, worker_id=self.state.worker_id,
            endpoint=self.state.endpoint, engine_version=_version(),
            limits=worker_pb2.WorkerLimits(max_message_bytes=self.state.max_message_bytes)))
        return info

    async def GetLoad(self, request, context: grpc.aio.ServicerContext) -> worker_pb2.Load:
        try:
            load = await self.answers.load_report(self.state)
        except DisaggError as exc:
            await abort_with(context, exc)
        load.timestamp_unix_ms = int(time.time() * 1000)
        return load

    async def SubscribeKvEvents(self, request, context: grpc.aio.ServicerContext):
        """A snapshot of the prefix cache, then live events, numbered per subscription (a gap: resubscribe)."""
        if self.answers.no_kv_events:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, self.answers.no_kv_events)
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


def _version() -> str:
    try:
        return metadata.version("disagg")
    except metadata.PackageNotFoundError:
        return "unknown"


# --- the engine workers' role spec ---

AddServicers = Callable[[grpc.aio.Server, WorkerState, argparse.Namespace], None]


@dataclass(frozen=True)
class EngineRole:
    """Prefill or decode: an engine from common.engine.start.start_engine, and the services on it."""

    role: int
    description: str
    service_names: list[str]
    add_servicers: AddServicers
    add_role_args: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    no_kv_events: str = ""

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        add_transport_args(parser)
        self.add_role_args(parser)
        add_engine_args(parser)

    def configure(self, args: argparse.Namespace) -> EngineConfig:
        # args hold --engine-config's and --engine-overrides' values after this too
        config = engine_config_from_args(args)
        if self.role == worker_pb2.WORKER_ROLE_PREFILL and config.speculative_config is not None:
            # Its prompts end at their first token and never draft: no draft model or EAGLE head to load for them.
            log.info("speculative decoding is the decode workers': this prefill worker runs without its %s drafts",
                     config.speculative_config.method)
            config, args.speculative_config = config.replace(speculative_config=None), None
        args.kv_transports = parse_transports(args.kv_transports)
        log.info("engine config: %s", effective_engine_json(args, config))
        return config

    def new_state(self, args: argparse.Namespace, config: EngineConfig, model_name: str) -> WorkerState:
        return WorkerState(self.role, model_name, args.max_message_bytes,
                           kv_transports=args.kv_transports,
                           engine_config_json=effective_engine_json(args, config))

    def load(self, state: WorkerState, config: EngineConfig) -> Engine:
        return start_engine(config)

    async def attach(self, state: WorkerState, engine: Engine) -> None:
        """The worker's KV path, by what its engine can do: over our data plane a prefill worker shares its
        engine's cache with importers; through an engine's own transport (trtllm) its TensorStore only releases
        sessions. The path is also what the TensorStore serves (its exporter's role)."""
        state.kv_layout = (await engine.facts()).kv_layout
        state.kv_path = await open_path(engine, state.role == worker_pb2.WORKER_ROLE_PREFILL,
                                        state.kv_transports, state.worker_id, state.metrics)
        state.closers.append(state.kv_path.close)
        if hasattr(engine, "output_wait") and state.metrics is not None:  # our engine's bridge (not trtllm's)
            engine.output_wait = state.metrics.get("disagg_engine_output_wait_seconds").observe
            engine.grammar_compiles = functools.partial(observe_grammar_compile, state.metrics)
            engine.step_done = functools.partial(observe_engine_step, state.metrics)
            if engine.spec_metrics is not None:  # speculative decoding's drafts and acceptance
                engine.spec_metrics.bind(state.metrics)
        state.engine = engine
        state.tensor_source = state.kv_path

    def registration_meta(self, state: WorkerState) -> dict[str, str]:
        layout = state.kv_layout
        return {"fingerprint": layout.fingerprint, "block_size": str(layout.block_size),
                "worker_id": state.worker_id, "dtype": layout.dtype}

    async def background(self, state: WorkerState, stop: asyncio.Event, every_s: float = 1.0) -> None:
        """Keep the engine gauges (running, waiting, KV usage, sessions) fresh for Prometheus scrapes."""
        while not stop.is_set():
            observe_engine_load(state.metrics, _load_proto(await state.engine.load()))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)  # returns at once on shutdown

    async def info(self, state: WorkerState) -> worker_pb2.WorkerInfo:
        facts = await state.require_engine().facts()
        layout = facts.kv_layout
        return worker_pb2.WorkerInfo(
            fingerprint=layout.fingerprint, block_size=layout.block_size, num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype,
            max_model_len=facts.max_model_len, limits=_limits(facts.config), engine=facts.name,
            transfer_backends=state.kv_path.transfer_backends(),
            supports_images=facts.image_token_id is not None,
            tensor_parallel_size=facts.config.tensor_parallel_size, engine_config_json=state.engine_config_json,
        )

    async def load_report(self, state: WorkerState) -> worker_pb2.Load:
        return _load_proto(await state.require_engine().load())

    async def held(self, state: WorkerState) -> int:
        """Exported KV sessions a decode worker has still to pull or release."""
        return (await state.engine.load()).active_sessions if state.engine is not None else 0

    async def abort(self, state: WorkerState) -> int:
        return await state.engine.abort_all() if state.engine is not None else 0

    async def close(self, state: WorkerState) -> str:
        if state.engine is None:
            return "no engine was loaded"
        released = await state.engine.release_all_sessions()
        await asyncio.to_thread(state.engine.shutdown)
        return f"released {released} KV sessions"


def _limits(config: EngineConfig) -> worker_pb2.WorkerLimits:
    return worker_pb2.WorkerLimits(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_waiting_requests=config.max_waiting, max_top_logprobs=SamplingParams.MAX_TOP_LOGPROBS,
        session_ttl_ms=int(config.session_ttl_s * 1000),
    )


def _load_proto(load: EngineLoad) -> worker_pb2.Load:
    return worker_pb2.Load(
        running_requests=load.running, waiting_requests=load.waiting, kv_blocks_total=load.kv_blocks_total,
        kv_blocks_free=load.kv_blocks_free, kv_usage_ratio=load.kv_usage_ratio,
        active_kv_sessions=load.active_sessions, expired_kv_sessions=load.expired_sessions,
        stored_tensors=load.active_sessions, stored_tensor_bytes=load.session_bytes,  # what TensorStore holds
        prompt_tokens_to_compute=load.prompt_tokens_to_compute,  # None: absent
        preemptions=load.preemptions,
    )

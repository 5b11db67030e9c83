"""Decoder servicer: one request per bidirectional stream (Decode), or many tagged on one (DecodeMany,
decode_many.py), each run by `begin`.

With a KvSessionRef the worker checks the layout, pulls the prompt's KV from the exporter's
TensorStore, releases the session and generates from the first token (GENERATION_ONLY);
without one it runs the prompt itself (CONTEXT_AND_GENERATION). Where the worker's KvPath is a transport its
engine drives (trtllm: a ref with TRANSFER_BACKEND_TRTLLM) nothing is pulled: the path makes the engine's
kv_import from the ref, the engine fetches the KV, and the session is released once the engine answers.
A ref whose KV moves another way than this worker's path is refused (FAILED_PRECONDITION). Once this worker accepts a
DecodeStart with a session it owns the session and releases it whatever happens next (also
when it refuses the request as invalid or mismatched); only when it is UNAVAILABLE (loading,
draining) does the caller keep it, to try another decode worker.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace

from common.engine.interface import Engine, EngineRequest, KvImport
from common.engine.request import FinishReason, RequestType, SamplingParams
from common.errors import InvalidRequest, NotFound, Unavailable
from common.kv.embeddings import pull_and_release_embeddings
from common.kv.layout import KvExport, KvLayout, PlacedKv, layout_of
from common.kv.paths import KvPath
from common.kv.wire import ChannelCache
from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.kit.convert import request_type_from_proto, sampling_from_proto
from services.decode.progress import Progress, join_delta
from services.decode.decode_many import DecodeManyStream
from common.telemetry import tracing
from services.kit.serving import abort_with
from services.worker.service import WorkerState

log = logging.getLogger(__name__)
SERVICE_NAMES = [worker_pb2.DESCRIPTOR.services_by_name["Decoder"].full_name]
def add_servicers(server: grpc.aio.Server, state: WorkerState, args: argparse.Namespace) -> None:
    channels = ChannelCache()  # to encode workers' TensorStores, for image embeddings
    servicer = DecodeServicer(state, channels, args.kv_pull_timeout, args.kv_load_failure_policy)
    state.closers.append(channels.close)
    worker_pb2_grpc.add_DecoderServicer_to_server(servicer, server)


@dataclass
class _Plan:
    """A validated DecodeStart."""

    request_id: str  # the caller's
    engine_id: str  # unique in the engine
    prompt: list[int]
    sampling: SamplingParams
    request_type: RequestType
    session: common_pb2.KvSessionRef | None
    first_token: int | None
    engine_import: KvImport | None  # a transport the engine drives: its kv_import, made from the ref (KvPath.engine_import)
    time_left_s: float | None = None  # the caller's deadline; the KV pull must not outlive it
    embeddings: list[common_pb2.EmbeddingRef] | None = None  # aggregated image requests: pulled here
    choices: list[int] = field(default_factory=list)  # n > 1: the choices run here (leader first)
    more_first_tokens: list[int] = field(default_factory=list)  # with a session: the other choices' first tokens


def _plan(start: worker_pb2.DecodeStart, layout: KvLayout, kv_path: KvPath) -> _Plan:
    has_session = start.HasField("session")
    request_type = request_type_from_proto(
        start.request_type, RequestType.GENERATION_ONLY if has_session else RequestType.CONTEXT_AND_GENERATION)
    if request_type is RequestType.CONTEXT_ONLY:
        raise InvalidRequest("Decode does not run CONTEXT_ONLY requests; call Prefiller.Prefill")
    if (request_type is RequestType.GENERATION_ONLY) != has_session:
        raise InvalidRequest(f"request_type {request_type.value} contradicts the request: generation_only needs a "
                             "session, context_and_generation takes none")
    if start.embeddings and has_session:
        raise InvalidRequest("embeddings go with aggregated requests; with a session the KV already holds the images")
    sampling = sampling_from_proto(start.sampling, start.stop, start.output)
    engine_import = None
    if has_session:
        _check_session(start, layout, kv_path)
        engine_import = kv_path.engine_import(start.session)
    choices = list(start.choice_indices) or list(range(sampling.n))
    if start.more_first_tokens and not has_session:
        raise InvalidRequest("more_first_tokens go with a session: without one the worker samples every choice")
    return _Plan(start.request_id, f"{start.request_id or 'decode'}-{uuid.uuid4().hex[:8]}", list(start.token_ids),
                 sampling, request_type, start.session if has_session else None,
                 start.first_token if has_session else None, engine_import, embeddings=list(start.embeddings),
                 choices=choices, more_first_tokens=list(start.more_first_tokens))


def _check_session(start: worker_pb2.DecodeStart, layout: KvLayout, kv_path: KvPath) -> None:
    ref = start.session
    kv_path.check(ref)
    if not start.HasField("first_token"):
        raise InvalidRequest("a DecodeStart with a session needs first_token")
    if start.first_token != ref.first_token:
        raise InvalidRequest(f"first_token {start.first_token} differs from the session's {ref.first_token}")
    if ref.num_tokens != len(start.token_ids):
        raise InvalidRequest(f"the session holds KV for {ref.num_tokens} tokens, the prompt has {len(start.token_ids)}")
    layout.check_compatible(layout_of(ref))


class DecodeServicer(worker_pb2_grpc.DecoderServicer):
    def __init__(self, state: WorkerState, channels: ChannelCache, pull_timeout_s: float,
                 kv_load_failure_policy: str = "recompute"):
        self.state = state
        self.channels = channels
        self.pull_timeout_s = pull_timeout_s
        self.recompute_on_failed_pull = kv_load_failure_policy == "recompute"

    async def Decode(self, request_iterator: AsyncIterator[worker_pb2.DecodeClientMessage],
                     context: grpc.aio.ServicerContext):
        try:
            start = await _read_start(request_iterator)
        except InvalidRequest as exc:
            await abort_with(context, exc)
        with self.state.admission.counted():  # the drain waits for the whole stream
            outbox: asyncio.Queue = asyncio.Queue()
            try:
                running = await self.begin(start, context.time_remaining(), outbox.put_nowait)
            except Exception as exc:
                await abort_with(context, exc)
            running.work.add_done_callback(lambda _: outbox.put_nowait(None))  # the stream ends however the work does
            watcher = asyncio.create_task(_watch(request_iterator, running, outbox))
            try:
                held = _NOTHING
                while (item := await outbox.get() if held is _NOTHING else held) is not None:
                    if isinstance(item, BaseException):
                        await abort_with(context, item)
                    item, held = _merge_waiting(item, outbox)
                    yield item
            finally:  # also when the client disappears: the work's cleanup frees everything
                watcher.cancel()
                running.work.cancel()

    async def DecodeMany(self, request_iterator: AsyncIterator[worker_pb2.DecodeManyRequest],
                         context: grpc.aio.ServicerContext):
        async for response in DecodeManyStream(self.state, self.begin).serve(request_iterator, context):
            yield response

    async def begin(self, start: worker_pb2.DecodeStart, time_left_s: float | None,
                    put: Callable[[object], None]) -> Running:
        """Admit `start` and run it: its messages, or the exception that ends it, go to `put`; the request has ended
        when Running.work has. Raises what refuses it, after giving back its session where that is ours to give."""
        try:
            engine = self.state.admit()
            plan = _plan(start, self.state.kv_layout, self.state.kv_path)
            plan.time_left_s = time_left_s
        except Exception as exc:
            await self._give_back_refused(start, exc)
            raise
        progress = Progress(plan.request_id, len(plan.prompt), plan.choices)

        def cancel_choice(index: int) -> None:  # one choice's stop string matched: the others go on
            progress.cancelled.add(index)
            self.state.spawn(engine.abort(f"{plan.engine_id}#{index}"))

        return Running(asyncio.create_task(self._work(engine, plan, put, progress)), cancel_choice)

    async def _give_back_refused(self, start: worker_pb2.DecodeStart, exc: Exception) -> None:
        """Release a refused request's session unless another decode worker could take it (this one is loading or
        draining)."""
        ref, kv_path = start.session, self.state.kv_path
        if start.HasField("session") and ref.endpoint and ref.session_id and not isinstance(exc, Unavailable) \
                and kv_path is not None:
            await asyncio.shield(kv_path.give_back(ref))

    async def _work(self, engine: Engine, plan: _Plan, put: Callable[[object], None], progress: Progress) -> None:
        span = tracing.tracer().start_span("decode", attributes={"disagg.request_id": plan.request_id,
                                                                 "disagg.request_type": plan.request_type.value})
        owed = plan.engine_import is not None  # the exporter's session, ours to release once the engine has the KV
        kv = None
        try:
            with trace.use_span(span, end_on_exit=False):
                kv = await self._kv_import(plan, progress)
                if plan.session is not None:
                    progress.kv_landed()
                images = (await pull_and_release_embeddings(self.channels.get, plan.embeddings, plan.time_left_s)
                          if plan.embeddings else None)
            self.state.require_engine()  # not if shutdown began during the pull
            request = EngineRequest(plan.engine_id, plan.prompt, plan.sampling, plan.request_type, kv,
                                    plan.first_token, images, plan.more_first_tokens, plan.choices)
            async for out in engine.generate(request):
                if owed:  # the engine answers once its transfer has brought the KV
                    self.state.kv_path.give_back(plan.session)
                    owed = False
                if out.finish_reason is FinishReason.ABORT and out.index not in progress.cancelled:
                    raise self.state.ended()
                if out.new_token_ids and progress.usage.completion_tokens == 0:
                    span.add_event("first_token")
                for message in progress.messages(out):
                    put(message)
        except asyncio.CancelledError:
            # generate() aborts a request it streams, but not one cancelled while being added.
            await asyncio.shield(engine.abort(plan.engine_id))
            put(progress.finished())
        except Exception as exc:
            span.record_exception(exc)
            put(exc)
        finally:
            if isinstance(kv, PlacedKv):
                kv.discard()  # blocks pulled into our pool but never taken by the engine (a no-op once taken)
            if owed:  # given back even when this RPC ends first (awaited as the path closes)
                self.state.kv_path.give_back(plan.session)
            span.set_attribute("disagg.decode.tokens", progress.usage.completion_tokens)
            span.end()

    async def _kv_import(self, plan: _Plan, progress: Progress) -> KvImport | None:
        """The request's kv_import: the engine's own import, or KV pulled over the data plane (None: recompute)."""
        if plan.engine_import is not None:
            progress.usage.kv_transfer_backend = plan.session.transfer_backend
            return plan.engine_import
        return await self._load_kv(plan, progress) if plan.session is not None else None

    async def _load_kv(self, plan: _Plan, progress: Progress) -> KvExport | PlacedKv | None:
        """The session's KV, or None to recompute the prompt here when the pull failed and the policy allows it."""
        try:
            with tracing.tracer().start_as_current_span("kv_pull", attributes={
                    "disagg.session_id": plan.session.session_id, "disagg.exporter": plan.session.endpoint}):
                return await self._pull(plan.session, plan.time_left_s, progress.usage)
        except (NotFound, Unavailable, InvalidRequest) as exc:  # InvalidRequest: a broken chunk stream
            self._count_load_failure("recompute" if self.recompute_on_failed_pull else "fail")
            if not self.recompute_on_failed_pull:
                raise
            image_token = (await self.state.require_engine().facts()).image_token_id
            if image_token is not None and image_token in plan.prompt:
                raise Unavailable(f"the KV of image request {plan.request_id} could not be pulled ({exc}) and cannot "
                                  "be recomputed here without its images; retry the request") from None
            log.warning("request %s: KV load failed (%s); recomputing its %d prompt tokens here", plan.request_id,
                        exc, len(plan.prompt))
            return None

    def _count_load_failure(self, action: str) -> None:
        if self.state.metrics is not None:
            self.state.metrics.get("disagg_kv_load_failures_total", action=action).inc()

    async def _pull(self, ref: common_pb2.KvSessionRef, time_left_s: float | None,
                    usage: common_pb2.Usage) -> KvExport | PlacedKv:
        timeout_s = self.pull_timeout_s if time_left_s is None else min(self.pull_timeout_s, time_left_s)
        pulled = await self.state.kv_path.import_kv(ref, timeout_s)
        log.debug("pulled %d KV bytes of session %s through %s in %.2f ms", pulled.num_bytes, ref.session_id,
                  pulled.transport, pulled.seconds * 1000)
        span = trace.get_current_span()
        span.set_attribute("disagg.kv_pull.bytes", pulled.num_bytes)
        span.set_attribute("disagg.kv_pull.seconds", pulled.seconds)
        span.set_attribute("disagg.kv_pull.backend", pulled.transport)
        usage.kv_transfer_backend = pulled.transfer_backend
        usage.kv_transfer_bytes, usage.kv_transfer_ms = pulled.num_bytes, pulled.seconds * 1000
        if self.state.metrics is not None:
            self.state.metrics.get("disagg_kv_pull_bytes_total", backend=pulled.transport).inc(pulled.num_bytes)
            self.state.metrics.get("disagg_kv_pull_seconds", backend=pulled.transport).observe(pulled.seconds)
        return pulled.export


@dataclass
class Running:
    """A request this worker accepted: the task that runs it, and how its caller cancels it or one choice."""

    work: asyncio.Task
    cancel_choice: Callable[[int], None]

    def cancel(self, index: int | None = None) -> None:
        if index is None:
            self.work.cancel()
        else:
            self.cancel_choice(index)


_NOTHING = object()


def _merge_waiting(message: worker_pb2.DecodeServerMessage,
                   outbox: asyncio.Queue) -> tuple[worker_pb2.DecodeServerMessage, object]:
    """`message` with the deltas of its choice that the engine made while the last write was under way (a router
    reading slower than this worker generates), as one message: a worker that keeps up sends each step's tokens
    alone, one that falls behind sends fewer messages instead of falling further behind. Returns it and the next
    item taken from the outbox that could not join it (_NOTHING: none)."""
    if not message.HasField("delta"):
        return message, _NOTHING
    while not outbox.empty():
        following = outbox.get_nowait()
        if not join_delta(message, following):
            return message, following
    return message, _NOTHING


async def _read_start(request_iterator: AsyncIterator[worker_pb2.DecodeClientMessage]) -> worker_pb2.DecodeStart:
    try:
        message = await anext(aiter(request_iterator), None)
    except DecodeError as exc:
        raise InvalidRequest(f"could not parse a DecodeClientMessage: {exc}") from None
    if message is None:
        raise InvalidRequest("the Decode stream closed before its `start` message")
    if message.WhichOneof("kind") != "start":
        raise InvalidRequest("the first Decode message must be `start`")
    return message.start


async def _watch(request_iterator: AsyncIterator[worker_pb2.DecodeClientMessage], running: Running,
                 outbox: asyncio.Queue) -> None:
    """Reads the rest of the stream: `cancel` cancels the request (with an index, that choice alone); a half-close
    changes nothing."""
    try:
        async for message in request_iterator:
            if message.WhichOneof("kind") != "cancel":
                outbox.put_nowait(InvalidRequest("a Decode stream carries one request: one `start`, then only "
                                                 "`cancel`"))
                return
            running.cancel(message.cancel.index if message.cancel.HasField("index") else None)
            if not message.cancel.HasField("index"):
                return
    except DecodeError as exc:
        outbox.put_nowait(InvalidRequest(f"could not parse a DecodeClientMessage: {exc}"))

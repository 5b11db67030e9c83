"""One request through the workers, in order: encode → prefill → decode with the KV session, or aggregated on a
decode worker. The unary calls and every release rule are the handoff's (handoff.py); the Decode stream and its
migration are decode_stream.py's.

Every worker RPC lives inside an async generator that the caller closes (contextlib.aclosing):
when the client cancels or disconnects, closing it cancels the in-flight Prefill or Decode call,
and a KV session that no decode worker took over is released on its prefill worker.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import grpc

from common.discovery import Role
from common.errors import DeadlineExceeded, FailedPrecondition, ResourceExhausted, Unavailable
from common.pb.disagg.v1 import common_pb2
from common.telemetry import tracing
from common.telemetry.metrics import Metrics
from services.router.config import RouterConfig
from services.router.deadline import Deadline
from services.router.decode_stream import DecodeStream, aggregated_start, continuation_start, handoff_start
from services.router.disagg_decision import DisaggConfig, PrefillPlacement
from services.router import policies
from services.router.handoff import Handoff, PrefillReady, first_token_ends
from services.router.generation import Event, GenerationRequest, ServedModel
from services.router.prepare import PreparedRequest, RequestPreparer
from services.router.streaming import ResponseBuilder
from services.router.workers import WorkerClient, WorkerPool
from services.kit.serving import status_of

log = logging.getLogger(__name__)

_DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED


@dataclass(eq=False)
class _InFlight:
    """A request being generated: its task, and whether the task is with the request's consumer (a front door
    writing the last event) rather than inside the request."""

    task: asyncio.Task
    with_consumer: bool = False


class Orchestrator:
    def __init__(self, pool: WorkerPool, preparer: RequestPreparer, config: RouterConfig,
                 metrics: Metrics | None = None):
        self._metrics = metrics
        self._pool = pool
        self._preparer = preparer
        self._config = config
        context = policies.PolicyContext(pool.kv_index, config.kv_overlap_weight, config.kv_load_weight)
        self._policies = {role: policies.build(config.policy, role, context)
                          for role in (Role.PREFILL, Role.DECODE, Role.ENCODE)}
        prefill_policy = self._policies[Role.PREFILL]
        self._placement = PrefillPlacement(
            DisaggConfig(config.min_remote_prefill_tokens, config.max_local_prefill_tokens,
                         config.max_prefill_queue_tokens), prefill_policy, metrics)
        self._handoff = Handoff(pool, prefill_policy, config.policy, metrics)
        self._decode = DecodeStream(pool, lambda refused: self._pick(Role.DECODE, exclude=refused),
                                    config.migration_limit)
        # One thread: HF tokenizers are not meant to be driven from several threads at once.
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.inflight = 0
        self.draining = False
        self._running: set[_InFlight] = set()  # for end_inflight
        self._ended: str | None = None

    def response(self, request_id: str) -> ResponseBuilder:
        return ResponseBuilder(request_id, self._preparer.tokenizer, metrics=self._metrics)

    def served_model(self) -> ServedModel:
        model = self._pool.model()
        if model is None:
            raise Unavailable("no decode worker is ready; the router cannot serve yet")
        image_tokens = self._preparer.image_tokens
        return ServedModel(self._config.model_name or model.name, model.max_model_len,
                           image_token=image_tokens.token if image_tokens is not None else None)

    def ready(self) -> bool:
        """Serving: every discovered worker has been heard from, a decode worker is ready, not draining."""
        return self._pool.settled and bool(self._pool.ready(Role.DECODE)) and not self.draining

    def rejected(self, exc: BaseException) -> None:
        """A request a front door refused before the core saw it (bad JSON, a bad sampling value) still counts
        in disagg_requests_total under its status."""
        self.response("").close(status_of(exc))

    def end_inflight(self, reason: str) -> None:
        """Past the router's --drain-timeout: every request still running ends with UNAVAILABLE(reason), its
        worker calls cancelled (which frees their KV)."""
        self._ended = reason
        for flight in self._running:
            if not flight.with_consumer:  # one with its consumer ends when it asks for its next event
                flight.task.cancel()

    async def close(self) -> None:
        self._tokenize.shutdown(wait=False, cancel_futures=True)

    async def stream(self, request: GenerationRequest, timeout_s: float | None = None) -> AsyncIterator[Event]:
        """What a front door calls: TextDelta events then one Finished (STOP or LENGTH). Failures raise the
        typed error (common.errors) or a worker's AioRpcError; leaving early cancels the request, frees its KV on
        every worker and counts it as CANCELLED."""
        out = self.response(request.request_id)
        try:
            async with contextlib.aclosing(self.generate(request, out, timeout_s)) as events:
                async for event in events:
                    yield event
        except Exception as exc:
            out.close(status_of(exc))
            raise
        finally:
            out.close(grpc.StatusCode.CANCELLED)  # a no-op after an outcome: only a consumer that left gets here first

    async def generate(self, request: GenerationRequest, out: ResponseBuilder,
                       rpc_time_remaining_s: float | None = None) -> AsyncIterator[Event]:
        """Deltas then one Finished; raises the typed error (or the worker's AioRpcError) on failure.

        The request's deadline (GenerationRequest.timeout_ms, or the RPC's if earlier) goes with every
        worker call as its gRPC deadline, so a worker cancels the request (freeing its blocks) when it passes.
        """
        deadline = Deadline.of(request.timeout_ms, rpc_time_remaining_s)
        with self._admitted() as flight:
            model = self.served_model()
            loop = asyncio.get_running_loop()
            with tracing.tracer().start_as_current_span("tokenize") as span:
                prepared = await loop.run_in_executor(self._tokenize, self._preparer.prepare, request, model)
                span.set_attribute("disagg.prompt_tokens", len(prepared.prompt))
            out.bind(prepared)
            try:
                async with contextlib.aclosing(self._run(prepared, out, deadline)) as responses:
                    async for response in responses:
                        flight.with_consumer = True
                        yield response
                        flight.with_consumer = False
                        if self._ended is not None:
                            raise Unavailable(self._ended)
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not _DEADLINE_EXCEEDED:
                    raise
                raise DeadlineExceeded(f"request {out.request_id} passed its deadline of {deadline.budget_ms} ms "
                                       f"after {out.completion_tokens} tokens were delivered") from None

    @contextlib.contextmanager
    def _admitted(self) -> Iterator[_InFlight]:
        if self.draining:
            raise Unavailable("the router is draining and takes no new requests; send this one to another router")
        limit = self._config.max_inflight_requests
        if self.inflight >= limit:
            raise ResourceExhausted(f"the router has {self.inflight} requests in flight, its limit "
                                    f"(--max-inflight-requests={limit}); retry later")
        flight = _InFlight(asyncio.current_task())
        self._running.add(flight)
        self.inflight += 1
        try:
            yield flight
        except asyncio.CancelledError:
            if self._ended is None:
                raise
            flight.task.uncancel()  # end_inflight's cancel becomes the request's status
            raise Unavailable(self._ended) from None
        finally:
            self.inflight -= 1
            self._running.discard(flight)

    async def _run(self, req: PreparedRequest, out: ResponseBuilder, deadline: Deadline) -> AsyncIterator[Event]:
        decode = await self._pick(Role.DECODE)
        if decode is None:
            raise Unavailable("no decode worker is available")
        with decode.busy():
            # Nothing may be awaited between the placement and the prefill call: see PrefillPlacement.
            prefill = await self._placement.place(req.prompt, decode, lambda: self._pick(Role.PREFILL, req.prompt))
            if req.images:
                flow = self._with_images(prefill, decode, req, out, deadline)
            else:
                flow = (self._disaggregated(prefill, decode, req, out, deadline) if prefill is not None
                        else self._decode.run(decode, req, out, aggregated_start(req), deadline))
            async with contextlib.aclosing(flow) as responses:
                async for response in responses:
                    yield response

    async def _pick(self, role: Role, prompt: list[int] | None = None,
                    exclude: set[WorkerClient] = frozenset()) -> WorkerClient | None:
        workers = [w for w in self._pool.ready(role) if w not in exclude]
        return await self._policies[role].pick(workers, prompt) if workers else None

    async def _disaggregated(self, prefill: WorkerClient, decode: WorkerClient, req: PreparedRequest,
                             out: ResponseBuilder, deadline: Deadline) -> AsyncIterator[Event]:
        out.dispatched()
        ready = await self._handoff.prefill(prefill, req, deadline)
        if ready is None:
            flow = self._decode.run(decode, req, out, aggregated_start(req), deadline)
        else:
            flow = self._after_prefill(ready, decode, req, out, deadline)
        async with contextlib.aclosing(flow) as responses:
            async for response in responses:
                yield response

    async def _with_images(self, prefill: WorkerClient | None, decode: WorkerClient, req: PreparedRequest,
                           out: ResponseBuilder, deadline: Deadline) -> AsyncIterator[Event]:
        """encode → prefill (pulls and releases the embeddings) → decode with the KV session; without a
        prefill worker (or below --min-remote-prefill-tokens) the decode worker pulls them and runs aggregated."""
        refs = await self._encode(req, deadline)
        ready = None
        try:
            if prefill is not None:
                out.dispatched()
                ready = await self._handoff.prefill(prefill, req, deadline, refs)
            if ready is None:
                start = aggregated_start(req)
                start.embeddings.extend(refs)
                flow = self._decode.run(decode, req, out, start, deadline)
            else:
                flow = self._after_prefill(ready, decode, req, out, deadline)
            async with contextlib.aclosing(flow) as responses:
                async for response in responses:
                    yield response
        finally:
            if ready is None:  # whoever pulled them released them; this frees what a failure or cancel left
                self._handoff.releaser.embeddings(refs)

    async def _encode(self, req: PreparedRequest, deadline: Deadline) -> list[common_pb2.EmbeddingRef]:
        """The embeddings of the request's images; an encode worker that refuses (UNAVAILABLE: draining, gone)
        passes the request on to another."""
        refused: set[WorkerClient] = set()
        while (encoder := await self._pick(Role.ENCODE, exclude=refused)) is not None:
            try:
                return await self._handoff.encode(encoder, req, deadline)
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise
                log.info("request %s: encode worker %s refused it (%s)", req.request_id, encoder.endpoint,
                         exc.details())
                refused.add(encoder)
        raise FailedPrecondition(f"the request has {len(req.images)} images but no encode worker is available; "
                                 "start one (disagg encode) and list it in --encode-workers")

    async def _after_prefill(self, ready: PrefillReady, decode: WorkerClient, req: PreparedRequest,
                             out: ResponseBuilder, deadline: Deadline) -> AsyncIterator[Event]:
        """The first token prefill sampled, then decode with its KV session (released on every other path)."""
        with ready.session as session:
            out.cached_prompt_tokens = ready.response.cached_tokens
            out.prefilled(ready.response.ttft_breakdown)
            response = out.delta([ready.first_token], [ready.first_logprob()])
            if response is not None:
                yield response
            ending = first_token_ends(req, out, ready.first_token, self._preparer.facts.eos_token_ids)
            if ending is not None:
                for response in out.finish(*ending):
                    yield response
                return
            start = (handoff_start(req, ready.first_token, session.ref) if session.ref is not None
                     else continuation_start(req, [ready.first_token]))
            async with contextlib.aclosing(self._decode.run(decode, req, out, start, deadline, session)) as responses:
                async for response in responses:
                    yield response

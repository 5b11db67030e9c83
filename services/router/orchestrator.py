"""One request through the workers: prefill → decode with the KV session, or aggregated on a decode worker.

Every worker RPC lives inside an async generator that the caller closes (contextlib.aclosing):
when the client cancels or disconnects, closing it cancels the in-flight Prefill or Decode call,
and a KV session that no decode worker took over is released on its prefill worker.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Iterator

import grpc
from opentelemetry import trace

from common.discovery import Role
from common.engine.request import FinishReason
from common.engine.stopping import StopRule
from common.errors import DeadlineExceeded, FailedPrecondition, ResourceExhausted, Unavailable
from common.pb.disagg.v1 import common_pb2, generation_pb2, worker_pb2
from common.telemetry import tracing
from common.telemetry.metrics import Metrics
from services.convert import worker_stop_conditions
from services.router.config import RouterConfig
from services.router.disagg_decision import DisaggConfig, PrefillPlacement
from services.router.kv_index import KvIndex
from services.router.policies import KvAware, KvAwareWeights, make_policy
from services.router.prepare import PreparedRequest, RequestPreparer, ServedModel
from services.router.streaming import Response, ResponseBuilder
from services.router.workers import WorkerClient, WorkerPool

log = logging.getLogger(__name__)

_RELEASE_TIMEOUT_S = 5.0
# How long a decode worker may take to confirm a cancel (its blocks are free when it does).
_CANCEL_ACK_TIMEOUT_S = 5.0
_DEADLINE_EXCEEDED, _UNAVAILABLE = grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE
_STOP, _LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


class Orchestrator:
    def __init__(self, pool: WorkerPool, preparer: RequestPreparer, config: RouterConfig,
                 metrics: Metrics | None = None):
        self._metrics = metrics
        self._pool = pool
        self._preparer = preparer
        self._config = config
        self.kv_index = KvIndex() if config.policy == "kv_aware" else None
        weights = KvAwareWeights(config.kv_overlap_weight, config.kv_load_weight)
        self._policies = {role: make_policy(config.policy, role, self.kv_index, weights)
                          for role in (Role.PREFILL, Role.DECODE, Role.ENCODE)}
        kv = self._policies[Role.PREFILL]
        self._placement = PrefillPlacement(
            DisaggConfig(config.min_remote_prefill_tokens, config.max_local_prefill_tokens,
                         config.max_prefill_queue_tokens), kv if isinstance(kv, KvAware) else None, metrics)
        # One thread: HF tokenizers are not meant to be driven from several threads at once.
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.inflight = 0
        self.draining = False

    def response(self, request_id: str) -> ResponseBuilder:
        return ResponseBuilder(request_id, self._preparer.tokenizer, metrics=self._metrics)

    def served_model(self) -> ServedModel:
        model = self._pool.model()
        if model is None:
            raise Unavailable("no decode worker is ready; the router cannot serve yet")
        return ServedModel(self._config.model_name or model.name, model.max_model_len)

    async def close(self) -> None:
        self._tokenize.shutdown(wait=False, cancel_futures=True)
        if self.kv_index is not None:
            await self.kv_index.close()

    async def generate(self, request: generation_pb2.GenerateRequest, out: ResponseBuilder,
                       rpc_time_remaining_s: float | None = None) -> AsyncIterator[Response]:
        """Deltas then one Finished; raises the typed error (or the worker's AioRpcError) on failure.

        The request's deadline (GenerateRequest.timeout_ms, or the RPC's if earlier) goes with every
        worker call as its gRPC deadline, so a worker cancels the request (freeing its blocks) when it passes.
        """
        deadline = Deadline.of(request.timeout_ms, rpc_time_remaining_s)
        with self._admitted():
            model = self.served_model()
            loop = asyncio.get_running_loop()
            with tracing.tracer().start_as_current_span("tokenize") as span:
                prepared = await loop.run_in_executor(self._tokenize, self._preparer.prepare, request,
                                                      out.request_id, model)
                span.set_attribute("disagg.prompt_tokens", len(prepared.prompt))
            out.bind(prepared)
            try:
                async with contextlib.aclosing(self._run(prepared, out, deadline)) as responses:
                    async for response in responses:
                        yield response
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not _DEADLINE_EXCEEDED:
                    raise
                raise DeadlineExceeded(f"request {out.request_id} passed its deadline of {deadline.budget_ms} ms "
                                       f"after {out.completion_tokens} tokens were delivered") from None

    @contextlib.contextmanager
    def _admitted(self) -> Iterator[None]:
        if self.draining:
            raise Unavailable("the router is shutting down; send the request to another router")
        limit = self._config.max_inflight_requests
        if self.inflight >= limit:
            raise ResourceExhausted(f"the router has {self.inflight} requests in flight, its limit "
                                    f"(--max-inflight-requests={limit}); retry later")
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    async def _run(self, req: PreparedRequest, out: ResponseBuilder, deadline: Deadline) -> AsyncIterator[Response]:
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
                        else self._decode(decode, req, out, _aggregated_start(req), deadline))
            async with contextlib.aclosing(flow) as responses:
                async for response in responses:
                    yield response

    async def _pick(self, role: Role, prompt: list[int] | None = None) -> WorkerClient | None:
        workers = self._pool.ready(role)
        return await self._policies[role].pick(workers, prompt) if workers else None

    async def _disaggregated(self, prefill: WorkerClient, decode: WorkerClient, req: PreparedRequest,
                             out: ResponseBuilder, deadline: Deadline) -> AsyncIterator[Response]:
        ready = await self._prefill(prefill, req, deadline)
        if ready is None:
            flow = self._decode(decode, req, out, _aggregated_start(req), deadline)
        else:
            flow = self._after_prefill(ready, decode, req, out, deadline)
        async with contextlib.aclosing(flow) as responses:
            async for response in responses:
                yield response

    async def _with_images(self, prefill: WorkerClient | None, decode: WorkerClient, req: PreparedRequest,
                           out: ResponseBuilder, deadline: Deadline) -> AsyncIterator[Response]:
        """encode → prefill (pulls and releases the embeddings) → decode with the KV session; without a
        prefill worker (or below --min-remote-prefill-tokens) the decode worker pulls them and runs aggregated."""
        refs = await self._encode(req, deadline)
        ready = None
        try:
            if prefill is not None:
                ready = await self._prefill(prefill, req, deadline, refs)
            if ready is None:
                start = _aggregated_start(req)
                start.embeddings.extend(refs)
                flow = self._decode(decode, req, out, start, deadline)
            else:
                flow = self._after_prefill(ready, decode, req, out, deadline)
            async with contextlib.aclosing(flow) as responses:
                async for response in responses:
                    yield response
        finally:
            if ready is None:  # whoever pulled them released them; this frees what a failure or cancel left
                self._release_embeddings(refs)

    async def _encode(self, req: PreparedRequest, deadline: Deadline) -> list[common_pb2.EmbeddingRef]:
        worker = await self._pick(Role.ENCODE)
        if worker is None:
            raise FailedPrecondition(f"the request has {len(req.images)} images but no encode worker is available; "
                                     "start one (disagg encode) and list it in --encode-workers")
        request = worker_pb2.EncodeRequest(request_id=req.worker_request_id, images=req.images)
        call = worker.encoder.Encode(request, timeout=deadline.remaining_s())
        with tracing.tracer().start_as_current_span("encode", attributes={
                "disagg.worker": worker.endpoint, "disagg.images": len(req.images)}):
            try:
                with worker.busy():
                    return list((await asyncio.shield(call)).embeddings)
            except asyncio.CancelledError:
                if not call.cancel():  # it had already answered: free what it stored
                    self._pool.spawn(self._release_encoded(call))
                raise
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.UNAVAILABLE:
                    self._pool.mark_down(worker, exc.details())
                raise

    async def _release_encoded(self, call: grpc.aio.UnaryUnaryCall) -> None:
        try:
            response = await call
        except grpc.aio.AioRpcError:
            return
        self._release_embeddings(list(response.embeddings))

    def _release_embeddings(self, refs: list[common_pb2.EmbeddingRef]) -> None:
        """Free embeddings no prefill worker took; in the background, so a cancelled request still does it."""
        for ref in refs:
            self._release_handle(ref.endpoint, ref.handle, "embedding")

    async def _prefill(self, worker: WorkerClient, req: PreparedRequest, deadline: Deadline,
                       embeddings: list[common_pb2.EmbeddingRef] = ()) -> worker_pb2.PrefillResponse | None:
        """The prefill's answer, or None when the worker is unreachable (the caller runs aggregated)."""
        request = worker_pb2.PrefillRequest(request_id=req.worker_request_id, token_ids=req.prompt,
                                            sampling=req.sampling, output=req.output, embeddings=embeddings)
        policy = self._policies[Role.PREFILL]
        predicted = policy.cached_tokens(worker, req.prompt) if isinstance(policy, KvAware) else None
        with tracing.tracer().start_as_current_span("prefill", attributes={
                "disagg.worker": worker.endpoint, "disagg.prompt_tokens": len(req.prompt)}):
            with worker.prefilling(len(req.prompt) - (predicted or 0)):  # the tokens it must compute
                ready = await self._prefill_call(worker, req, request, deadline)
        self._count_routing(predicted, ready)
        return ready

    def _count_routing(self, predicted_cached: int | None, ready: worker_pb2.PrefillResponse | None) -> None:
        """Routing decisions, and the cache hit the policy predicted next to the one the worker reported."""
        if self._metrics is None:
            return
        self._metrics.get("disagg_routing_decisions_total", policy=self._config.policy).inc()
        if predicted_cached is not None and ready is not None:
            self._metrics.get("disagg_routing_cached_tokens_total", source="predicted").inc(predicted_cached)
            self._metrics.get("disagg_routing_cached_tokens_total", source="actual").inc(ready.cached_tokens)

    async def _prefill_call(self, worker: WorkerClient, req: PreparedRequest, request: worker_pb2.PrefillRequest,
                            deadline: Deadline) -> worker_pb2.PrefillResponse | None:
        call = worker.prefiller.Prefill(request, timeout=deadline.remaining_s())
        try:
            with worker.busy():
                return await asyncio.shield(call)
        except asyncio.CancelledError:
            # Not call.cancel(): a cancel that races the answer loses the session ref on the wire while the
            # worker has already exported it (it held blocks until its TTL). Let the prefill answer, then release.
            self._pool.spawn(self._release_answered(call))
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                raise
            self._pool.mark_down(worker, exc.details())
            log.warning("request %s: prefill worker %s unavailable; running aggregated", req.request_id,
                        worker.endpoint)
            return None

    async def _after_prefill(self, ready: worker_pb2.PrefillResponse, decode: WorkerClient, req: PreparedRequest,
                             out: ResponseBuilder, deadline: Deadline) -> AsyncIterator[Response]:
        session = ready.session if ready.HasField("session") else None
        handed_over = False
        try:
            out.cached_prompt_tokens = ready.cached_tokens
            first = common_pb2.TokenLogprob(token_id=ready.first_token, logprob=ready.first_token_logprob,
                                            top_logprobs=ready.first_token_top_logprobs)
            response = out.delta([ready.first_token], [first])
            if response is not None:
                yield response
            ending = self._first_token_ends(req, out, ready.first_token)
            if ending is not None:
                for response in out.finish(*ending):
                    yield response
                return
            start = (_handoff_start(req, ready.first_token, session) if session
                     else _continuation_start(req, [ready.first_token]))
            handed_over = True
            async with contextlib.aclosing(self._decode(decode, req, out, start, deadline)) as responses:
                async for response in responses:
                    yield response
        finally:
            if session is not None and not handed_over:
                self._release(session)

    def _first_token_ends(self, req: PreparedRequest, out: ResponseBuilder, token: int) -> tuple[int, int | None] | None:
        """(reason, matched stop token id) when the token prefill sampled already ends the request."""
        if out.stopped:
            return _STOP, None
        rule = StopRule.of(req.params, self._preparer.facts.eos_token_ids, len(req.prompt), req.max_model_len)
        reason = rule.check(token, len(req.prompt) + 1)
        if reason is FinishReason.STOP:
            return _STOP, token
        return None if reason is None else (_LENGTH, None)

    async def _decode(self, worker: WorkerClient, req: PreparedRequest, out: ResponseBuilder,
                      start: worker_pb2.DecodeStart, deadline: Deadline) -> AsyncIterator[Response]:
        """Stream from a decode worker; if it is lost mid-stream, migrate (up to --migration-limit times)
        to another decode worker, which continues from the prompt and the tokens delivered so far."""
        for migration in itertools.count():
            try:
                async with contextlib.aclosing(self._decode_on(worker, req, out, start, deadline)) as responses:
                    async for response in responses:
                        yield response
                return
            except _DecodeLost as lost:
                other = await self._pick(Role.DECODE) if migration < self._config.migration_limit else None
                if other is None or other is worker:
                    raise Unavailable(f"decode worker {worker.endpoint} failed during request {req.request_id} "
                                      f"after {out.completion_tokens} tokens were delivered ({lost}); "
                                      "retry the request") from None
                log.warning("request %s: decode worker %s lost after %d tokens (%s); migrating to %s",
                            req.request_id, worker.endpoint, out.completion_tokens, lost, other.endpoint)
                worker, start = other, _continuation_start(req, out.token_ids)

    async def _decode_on(self, worker: WorkerClient, req: PreparedRequest, out: ResponseBuilder,
                         start: worker_pb2.DecodeStart, deadline: Deadline) -> AsyncIterator[Response]:
        session = start.session if start.HasField("session") else None
        span = tracing.tracer().start_span("decode", attributes={
            "disagg.worker": worker.endpoint, "disagg.kv_handoff": session is not None})
        with trace.use_span(span, end_on_exit=False):  # the call's client span (and the worker's) hang under it
            call = worker.decoder.Decode(timeout=deadline.remaining_s())
        delivered_before = out.completion_tokens
        answered = False
        try:
            await call.write(worker_pb2.DecodeClientMessage(start=start))
            async for message in call:
                answered = True
                if message.HasField("finished"):
                    for response in self._worker_finished(message.finished, session, out):
                        yield response
                    return
                response = out.delta(message.delta.token_ids, message.delta.logprobs)
                if response is not None:
                    yield response
                if out.stopped:  # a stop string: the worker generates on until told
                    finished = await _cancelled(call)
                    if finished is not None:
                        self._record_usage(finished, session, out)
                    for response in out.finish(_STOP):
                        yield response
                    return
            raise Unavailable(f"decode worker {worker.endpoint} ended request {req.request_id} without finishing it, "
                              f"after {out.completion_tokens} tokens were delivered")
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not _UNAVAILABLE:
                raise
            self._pool.mark_down(worker, exc.details())
            if not answered:
                raise
            raise _DecodeLost(exc.details()) from None
        finally:
            call.cancel()
            span.set_attribute("disagg.decode.tokens", out.completion_tokens - delivered_before)
            span.end()
            if session is not None and not answered:
                self._release(session)

    def _worker_finished(self, finished: common_pb2.Finished, session: common_pb2.KvSessionRef | None,
                         out: ResponseBuilder) -> list[Response]:
        self._record_usage(finished, session, out)
        stop_id = finished.matched_stop_token_id if finished.HasField("matched_stop_token_id") else None
        return out.finish(finished.reason, stop_id)

    @staticmethod
    def _record_usage(finished: common_pb2.Finished, session: common_pb2.KvSessionRef | None,
                      out: ResponseBuilder) -> None:
        if session is None:
            out.cached_prompt_tokens = finished.usage.cached_prompt_tokens
        else:  # how the KV came to decode, for the client's Finished.usage
            out.kv_transfer = (finished.usage.kv_transfer_backend, finished.usage.kv_transfer_bytes,
                               finished.usage.kv_transfer_ms)

    async def _release_answered(self, call: grpc.aio.UnaryUnaryCall) -> None:
        try:
            ready = await call
        except grpc.aio.AioRpcError:
            return
        if ready.HasField("session"):
            self._release(ready.session)

    def _release(self, session: common_pb2.KvSessionRef) -> None:
        """Free a KV session no decode worker took over; in the background, so a cancelled request still does it."""
        self._release_handle(session.endpoint, session.session_id, "KV session")

    def _release_handle(self, endpoint: str, handle: str, what: str) -> None:
        async def release() -> None:
            try:
                await self._pool.tensor_store(endpoint).Release(worker_pb2.ReleaseRequest(handle=handle),
                                                                timeout=_RELEASE_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                log.warning("releasing %s %s on %s failed: %s", what, handle, endpoint, exc.code().name)

        self._pool.spawn(release())


def _aggregated_start(req: PreparedRequest) -> worker_pb2.DecodeStart:
    return worker_pb2.DecodeStart(request_id=req.worker_request_id, token_ids=req.prompt, sampling=req.sampling,
                                  stop=worker_stop_conditions(req.stop), output=req.output)


def _handoff_start(req: PreparedRequest, first_token: int, session: common_pb2.KvSessionRef) -> worker_pb2.DecodeStart:
    start = _aggregated_start(req)
    start.first_token = first_token
    start.session.CopyFrom(session)
    return start


def _continuation_start(req: PreparedRequest, generated: list[int]) -> worker_pb2.DecodeStart:
    """Decode continues aggregated from the prompt and the tokens already delivered: after a prefill that
    ended the request where the router does not (it cannot know ignore_eos or stop token ids), or on
    another decode worker after a migration. Greedy output is the same; a seeded sampler's stream restarts."""
    start = _aggregated_start(req)
    start.token_ids.extend(generated)
    if req.sampling.HasField("max_tokens"):
        start.sampling.max_tokens = req.sampling.max_tokens - len(generated)
    return start


async def _cancelled(call: grpc.aio.StreamStreamCall) -> common_pb2.Finished | None:
    """Cancel the worker's request on its Decode stream and wait for its Finished: by then its blocks are free.
    None when the worker does not confirm in time or the stream breaks (cancelling the RPC frees them too)."""
    try:
        async with asyncio.timeout(_CANCEL_ACK_TIMEOUT_S):
            with contextlib.suppress(asyncio.InvalidStateError):  # the worker has ended the stream already
                await call.write(worker_pb2.DecodeClientMessage(cancel=common_pb2.Cancel()))
            async for message in call:
                if message.HasField("finished"):
                    return message.finished
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, TimeoutError) as exc:
        log.debug("decode worker did not confirm a cancel: %s", exc)
    return None


class _DecodeLost(Exception):
    """The decode worker went away (UNAVAILABLE) after it had started streaming."""


class Deadline:
    """When a request must be over, on the event loop's clock; `remaining_s` is what worker calls get."""

    def __init__(self, at: float | None, budget_ms: int):
        self.at = at
        self.budget_ms = budget_ms

    @classmethod
    def of(cls, timeout_ms: int, rpc_time_remaining_s: float | None) -> "Deadline":
        budgets = [s for s in (timeout_ms / 1000 if timeout_ms else None, rpc_time_remaining_s) if s is not None]
        if not budgets:
            return cls(None, 0)
        budget = min(budgets)
        return cls(asyncio.get_running_loop().time() + budget, round(budget * 1000))

    def remaining_s(self) -> float | None:
        """Seconds left (at least a millisecond, so an expired deadline still fails the call), None without one."""
        if self.at is None:
            return None
        return max(self.at - asyncio.get_running_loop().time(), 0.001)

"""Request path, after prepare.py: the Encode and Prefill calls (encode → prefill → first token, unary) and every
rule for freeing what they leave on workers.

Release rules, each written once here:
- A KV session prefill exported belongs to one `ExportedSession`, released on its prefill worker exactly once unless
  a decode worker took it over (answered on its Decode stream; it pulls and releases the KV itself). So the
  session is released when the first token ends the request, when the client cancels after prefill answered,
  and when decode refuses or fails before answering (UNAVAILABLE included: no other decode worker gets it).
- A client cancel racing prefill's or encode's answer does not cancel the call (the ref would be lost on the wire
  while the worker exported the session or stored the embeddings, held until their TTL): the worker answers,
  then what its answer names is released.
- Embeddings encode stored are released unless a prefill worker ran with them (it pulls and releases them).
Releases run in the background (the pool's tasks), so a cancelled request still does them.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

import grpc

from common.engine.request import FinishReason as EngineFinish
from common.engine.stopping import StopRule
from common.pb.disagg.v1 import common_pb2, worker_pb2
from common.telemetry import tracing
from common.telemetry.metrics import Metrics
from services.kit.convert import sampling_to_proto
from services.router.deadline import Deadline
from services.router.generation import FinishReason, ImageInput
from services.router.policies import Policy
from services.router.prepare import PreparedRequest
from services.router.workers import WorkerClient, WorkerPool

log = logging.getLogger(__name__)

_RELEASE_TIMEOUT_S = 5.0


class Releaser:
    """Frees what a worker stored for a request (a KV session, embeddings) on that worker's TensorStore."""

    def __init__(self, pool: WorkerPool):
        self._pool = pool

    def session(self, ref: common_pb2.KvSessionRef) -> None:
        self._release(ref.endpoint, ref.session_id, "KV session")

    def embeddings(self, refs: list[common_pb2.EmbeddingRef]) -> None:
        for ref in refs:
            self._release(ref.endpoint, ref.handle, "embedding")

    def once_answered(self, answer: asyncio.Future, release: Callable[[object], None]) -> None:
        """Let a call whose caller went away answer, then free what its answer names. `answer` is the task the
        caller shielded: reading its outcome here also retrieves its error ("Task exception was never retrieved")."""
        async def wait() -> None:
            try:
                response = await answer  # (cancelled with the call: nothing to free)
            except grpc.aio.AioRpcError:
                return
            release(response)

        self._pool.spawn(wait())

    def _release(self, endpoint: str, handle: str, what: str) -> None:
        async def release() -> None:
            try:
                await self._pool.tensor_store(endpoint).Release(worker_pb2.ReleaseRequest(handle=handle),
                                                                timeout=_RELEASE_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                log.warning("releasing %s %s on %s failed: %s", what, handle, endpoint, exc.code().name)

        self._pool.spawn(release())


class ExportedSession:
    """The one owner of a KV session prefill exported: released exactly once, unless a decode worker took it over.

    The request's Flight holds it and releases it when the request ends, whatever the path, unless a decode worker
    answered with it (`taken`).
    """

    def __init__(self, ref: common_pb2.KvSessionRef | None, releaser: Releaser):
        self.ref = ref
        self._releaser = releaser
        self._settled = ref is None

    def taken(self) -> None:
        """A decode worker answered on its Decode stream with the session: from now on it is that worker's."""
        self._settled = True

    def release(self) -> None:
        if not self._settled:
            self._settled = True
            self._releaser.session(self.ref)


@dataclass
class PrefillReady:
    """Prefill's answer: the first token (and its logprobs) and the KV session it exported, if any."""
    response: worker_pb2.PrefillResponse
    session: ExportedSession

    @property
    def first_token(self) -> int:
        return self.response.first_token

    def first_logprob(self) -> common_pb2.TokenLogprob:
        r = self.response
        return common_pb2.TokenLogprob(token_id=r.first_token, logprob=r.first_token_logprob,
                                       top_logprobs=r.first_token_top_logprobs)

    def first_logprobs(self) -> list[common_pb2.TokenLogprob]:
        """Every choice's first token and its logprobs, by index (n > 1)."""
        return [self.first_logprob(), *self.response.more_first_tokens]


class EncodePrefill:
    """Encode and Prefill calls: unary, each freeing what it stored when its caller goes away."""

    def __init__(self, pool: WorkerPool, prefill_policy: Policy, policy_name: str, metrics: Metrics | None = None):
        self._pool = pool
        self._policy = prefill_policy
        self._policy_name = policy_name
        self._metrics = metrics
        self.releaser = Releaser(pool)

    async def encode(self, worker: WorkerClient, req: PreparedRequest,
                     deadline: Deadline) -> list[common_pb2.EmbeddingRef]:
        request = worker_pb2.EncodeRequest(request_id=req.worker_request_id,
                                           images=[image_to_proto(image) for image in req.images])
        answer = asyncio.ensure_future(worker.encoder.Encode(request, timeout=deadline.remaining_s()))
        with tracing.tracer().start_as_current_span("encode", attributes={
                "disagg.worker": worker.endpoint, "disagg.images": len(req.images)}):
            try:
                with worker.busy():
                    return list((await asyncio.shield(answer)).embeddings)
            except asyncio.CancelledError:  # not cancelled: see the module doc
                self.releaser.once_answered(answer, lambda r: self.releaser.embeddings(list(r.embeddings)))
                raise
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.UNAVAILABLE:
                    self._pool.mark_down(worker, exc.details())
                raise

    async def prefill(self, worker: WorkerClient, req: PreparedRequest, deadline: Deadline,
                      embeddings: list[common_pb2.EmbeddingRef] = ()) -> PrefillReady | None:
        """Prefill's answer, or None when the worker is unreachable (the caller runs aggregated)."""
        sampling, _, output = sampling_to_proto(req.params)
        request = worker_pb2.PrefillRequest(request_id=req.worker_request_id, token_ids=req.prompt,
                                            sampling=sampling, output=output, embeddings=embeddings)
        predicted = self._policy.cached_tokens(worker, req.prompt)
        with tracing.tracer().start_as_current_span("prefill", attributes={
                "disagg.worker": worker.endpoint, "disagg.prompt_tokens": len(req.prompt)}):
            with worker.prefilling(len(req.prompt) - (predicted or 0)):  # the tokens it must compute
                response = await self._prefill_call(worker, req, request, deadline)
        self._count_routing(predicted, response)
        if response is None:
            return None
        return PrefillReady(response, ExportedSession(response.session if response.HasField("session") else None,
                                                self.releaser))

    async def _prefill_call(self, worker: WorkerClient, req: PreparedRequest, request: worker_pb2.PrefillRequest,
                            deadline: Deadline) -> worker_pb2.PrefillResponse | None:
        answer = asyncio.ensure_future(worker.prefiller.Prefill(request, timeout=deadline.remaining_s()))
        try:
            with worker.busy():
                return await asyncio.shield(answer)
        except asyncio.CancelledError:
            self.releaser.once_answered(answer, self._release_session_of)  # not cancelled: see the module doc
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                raise
            self._pool.mark_down(worker, exc.details())
            log.warning("request %s: prefill worker %s unavailable; running aggregated", req.request_id,
                        worker.endpoint)
            return None

    def _release_session_of(self, response: worker_pb2.PrefillResponse) -> None:
        if response.HasField("session"):
            self.releaser.session(response.session)

    def _count_routing(self, predicted_cached: int | None, ready: worker_pb2.PrefillResponse | None) -> None:
        """Routing decisions, and the cache hit the policy predicted next to the one the worker reported."""
        if self._metrics is None:
            return
        self._metrics.get("disagg_routing_decisions_total", policy=self._policy_name).inc()
        if predicted_cached is not None and ready is not None:
            self._metrics.get("disagg_routing_cached_tokens_total", source="predicted").inc(predicted_cached)
            self._metrics.get("disagg_routing_cached_tokens_total", source="actual").inc(ready.cached_tokens)


def first_token_ends(req: PreparedRequest, stopped: bool, token: int,
                     eos_token_ids: list[int]) -> tuple[FinishReason, int | None] | None:
    """(reason, matched stop token id) when the token prefill sampled already ends the request (`stopped`: its text
    matched a stop string)."""
    if stopped:
        return FinishReason.STOP, None
    rule = StopRule.of(req.params, eos_token_ids, len(req.prompt), req.max_model_len)
    reason = rule.check(token, len(req.prompt) + 1)
    if reason is EngineFinish.STOP:
        return FinishReason.STOP, token
    return None if reason is None else (FinishReason.LENGTH, None)


def image_to_proto(image: ImageInput) -> common_pb2.Image:
    if image.data is not None:
        return common_pb2.Image(data=image.data)
    if image.data_url is not None:
        return common_pb2.Image(data_url=image.data_url)
    if image.path is not None:
        return common_pb2.Image(path=image.path)
    return common_pb2.Image()  # no source: the encode worker says so

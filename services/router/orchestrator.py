"""Request path, the core (Core.stream, which every front door calls): one request's flat loop through the workers, in
order: encode → prefill → first token → decode with the KV session (rerouted when its decode worker is lost), or
aggregated on a decode worker.

The request's state is its Flight (flight.py), which front doors iterate (Core.stream); the unary calls and every
release rule are encode_prefill.py's; the Decode stream and where it goes next are decode_stream.py's.
A worker call awaited or streamed by the loop is cancelled when the flight is closed or cancelled, and what a worker
stored for the request (a KV session, embeddings) and no other worker took over is released when the loop ends.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Iterator

import grpc

from common.discovery import Role
from common.errors import DeadlineExceeded, FailedPrecondition, ResourceExhausted, Unavailable
from common.pb.disagg.v1 import common_pb2, worker_pb2
from common.telemetry import tracing
from common.telemetry.metrics import Metrics
from services.router.config import RouterConfig
from services.router.deadline import Deadline
from services.router.decode_stream import (DecodeInterrupted, DecodeRoute, DecodeStream, aggregated_start,
                                           continuation_start, handoff_start)
from services.router.disagg_decision import DisaggConfig, PrefillPlacement
from services.router.encode_prefill import EncodePrefill, PrefillReady
from services.router.flight import Flight
from services.router import policies
from services.router.loop_lag import LoopLagProbe
from services.router.generation import Event, GenerationRequest, ServedModel
from services.router.prepare import PreparedRequest, RequestPreparer
from services.router.responses import ResponseBuilder
from services.router.workers import WorkerClient, WorkerPool
from services.kit.serving import status_of

log = logging.getLogger(__name__)

_DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED


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
        self._encode_prefill = EncodePrefill(pool, prefill_policy, config.policy, metrics)
        self._decode = DecodeStream(pool, lambda refused: self._pick(Role.DECODE, exclude=refused),
                                    config.migration_limit, shared_streams=config.decode_streams == "shared")
        # One thread: HF tokenizers are not meant to be driven from several threads at once.
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.inflight = 0
        self.draining = False
        # How late the loop runs while requests are in flight (a busy router delays every token it relays).
        self._loop_lag = (LoopLagProbe(metrics.get("disagg_event_loop_lag_seconds").observe, lambda: self.inflight > 0)
                          if metrics is not None else None)
        self._running: set[Flight] = set()  # for end_inflight

    def stream(self, request: GenerationRequest, timeout_s: float | None = None) -> Flight:
        """What a front door calls: the request's events, TextDelta then one Finished (STOP or LENGTH; CANCELLED
        after Flight.cancel). Failures raise the typed error (common.errors) or a worker's AioRpcError; closing the
        stream early cancels the request, frees its KV on every worker and counts it as CANCELLED.

        The request's deadline (GenerationRequest.timeout_ms, or the RPC's `timeout_s` if earlier) goes with every
        worker call as its gRPC deadline, so a worker cancels the request (freeing its blocks) when it passes."""
        return Flight(request, self._response(request.request_id), Deadline.of(request.timeout_ms, timeout_s),
                      self._run)

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
        self._response("").close(status_of(exc))

    def end_inflight(self, reason: str) -> None:
        """Past the router's --drain-timeout: every request still running ends with UNAVAILABLE(reason), its
        worker calls cancelled (which frees their KV)."""
        for flight in list(self._running):
            flight.end(Unavailable(reason))

    async def close(self) -> None:
        self._tokenize.shutdown(wait=False, cancel_futures=True)
        if self._loop_lag is not None:
            await self._loop_lag.close()

    async def _run(self, flight: Flight) -> AsyncIterator[Event]:
        """The request's one loop: admitted, tokenised, encoded, prefilled (its first token), decoded; each decode
        worker event is applied to the flight, which gives the client's events. On the way out (done, failed,
        cancelled) what the workers hold for it and no other worker took over is released."""
        with self._admitted(flight):
            try:
                req = await self._prepare(flight)
                decode = await self._pick(Role.DECODE)
                if decode is None:
                    raise Unavailable("no decode worker is available")
                with decode.busy(), contextlib.ExitStack() as local_prefill:
                    # Nothing may be awaited between the placement and the prefill call: see PrefillPlacement.
                    prefill = await self._placement.place(req.prompt, decode,
                                                          lambda: self._pick(Role.PREFILL, req.prompt))
                    if req.images:  # the decode or prefill worker that runs the prompt pulls them
                        flight.embeddings = await self._encode(req, flight.deadline)
                    start = aggregated_start(req)
                    start.embeddings.extend(flight.embeddings)
                    ready = await self._prefill(flight, prefill) if prefill is not None else None
                    if ready is not None:
                        for event in flight.prefilled(ready, self._preparer.facts.eos_token_ids):
                            yield event
                        if flight.sent.finished:
                            return
                        start = self._after_prefill(flight, ready, req)
                    else:  # the decode worker prefills it: counted there until its first token (DecodeLoad.has_room)
                        local_prefill.enter_context(decode.prefilling(len(req.prompt)))
                    prefilling = ready is None
                    route = DecodeRoute(decode, start)
                    while True:
                        flight.sent.dispatched()
                        try:
                            async with contextlib.aclosing(self._decode.events(flight, route)) as events:
                                async for event in events:
                                    for client_event in flight.apply(event):
                                        if prefilling:
                                            prefilling = False
                                            local_prefill.close()
                                        yield client_event
                            return
                        except DecodeInterrupted as interrupted:
                            await self._decode.reroute(flight, route, interrupted)
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not _DEADLINE_EXCEEDED:
                    raise
                raise DeadlineExceeded(f"request {flight.request_id} passed its deadline of "
                                       f"{flight.deadline.budget_ms} ms after {flight.sent.completion_tokens} tokens "
                                       "were delivered") from None
            finally:
                flight.release(self._encode_prefill.releaser)

    @staticmethod
    def _after_prefill(flight: Flight, ready: PrefillReady, req: PreparedRequest) -> worker_pb2.DecodeStart:
        """The decode worker's start after prefill answered: with its session (n > 1: each running choice's first
        token), or, without one, continuing aggregated from the first token."""
        if ready.session.ref is None:
            if req.params.n > 1:  # our engine pins one for every multi-choice prompt: an engine that did not
                raise FailedPrecondition("the prefill worker exported no KV session for a request with n > 1")
            return continuation_start(req, [ready.first_token])
        choices = flight.first_tokens(ready) if req.params.n > 1 else None
        return handoff_start(req, ready.first_token, ready.session.ref, choices)

    async def _prepare(self, flight: Flight) -> PreparedRequest:
        model = self.served_model()
        loop = asyncio.get_running_loop()
        with tracing.tracer().start_as_current_span("tokenize") as span:
            prepared = await loop.run_in_executor(self._tokenize, self._preparer.prepare, flight.request, model)
            span.set_attribute("disagg.prompt_tokens", len(prepared.prompt))
        flight.bind(prepared)
        return prepared

    async def _prefill(self, flight: Flight, prefill: WorkerClient) -> PrefillReady | None:
        """Prefill's answer, or None when its worker is unreachable (the request runs aggregated)."""
        flight.sent.dispatched()
        return await self._encode_prefill.prefill(prefill, flight.prepared, flight.deadline, flight.embeddings)

    def _response(self, request_id: str) -> ResponseBuilder:
        return ResponseBuilder(request_id, self._preparer.tokenizer, metrics=self._metrics)

    @contextlib.contextmanager
    def _admitted(self, flight: Flight) -> Iterator[None]:
        if self.draining:
            raise Unavailable("the router is draining and takes no new requests; send this one to another router")
        limit = self._config.max_inflight_requests
        if self.inflight >= limit:
            raise ResourceExhausted(f"the router has {self.inflight} requests in flight, its limit "
                                    f"(--max-inflight-requests={limit}); retry later")
        self._running.add(flight)
        self.inflight += 1
        if self._loop_lag is not None:
            self._loop_lag.start()
        try:
            yield
        finally:
            self.inflight -= 1
            self._running.discard(flight)

    async def _pick(self, role: Role, prompt: list[int] | None = None,
                    exclude: set[WorkerClient] = frozenset()) -> WorkerClient | None:
        workers = [w for w in self._pool.ready(role) if w not in exclude]
        return await self._policies[role].pick(workers, prompt) if workers else None

    async def _encode(self, req: PreparedRequest, deadline: Deadline) -> list[common_pb2.EmbeddingRef]:
        """The embeddings of the request's images; an encode worker that refuses (UNAVAILABLE: draining, gone)
        passes the request on to another."""
        refused: set[WorkerClient] = set()
        while (encoder := await self._pick(Role.ENCODE, exclude=refused)) is not None:
            try:
                return await self._encode_prefill.encode(encoder, req, deadline)
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise
                log.info("request %s: encode worker %s refused it (%s)", req.request_id, encoder.endpoint,
                         exc.details())
                refused.add(encoder)
        raise FailedPrecondition(f"the request has {len(req.images)} images but no encode worker is available; "
                                 "start one (disagg encode) and list it in --encode-workers")

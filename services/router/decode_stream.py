"""Request path, decode, after encode_prefill.py: one request's Decode stream to a decode worker as plain events
(decode_events.py), and where the request goes when the worker is lost.

A decode worker that refuses the request before answering anything (UNAVAILABLE: draining, loading, gone) hands
the same start, KV session included (prefill still holds it), to another decode worker; the client sees nothing.
A decode worker lost mid-stream (UNAVAILABLE after it answered) is replaced by another one, up to
--migration-limit times, which continues aggregated from the prompt and the tokens delivered so far.
A stop string the flight matched cancels the worker's request and waits for its Finished (its blocks are free then).
This module reads the request's Flight (what the client has been sent) and never writes it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Union

import grpc
from opentelemetry import trace

from common.errors import Unavailable
from common.kv.offer import name_of
from common.pb.disagg.v1 import common_pb2, worker_pb2
from common.telemetry import tracing
from services.kit.convert import sampling_to_proto, worker_stop_conditions
from services.router.decode_events import (CachedTokens, DecodeEvent, DecodeFinished, KvHandoff, Tokens,
                                           WorkerTimings)
from services.router.decode_mux import MuxedDecodeCall
from services.router.generation import FinishReason
from services.router.prepare import PreparedRequest
from services.router.workers import WorkerClient, WorkerPool

if TYPE_CHECKING:
    from services.router.flight import Flight

log = logging.getLogger(__name__)

# How long a decode worker may take to confirm a cancel (its blocks are free when it does).
_CANCEL_ACK_TIMEOUT_S = 5.0
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: FinishReason.STOP, common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
                   common_pb2.FINISH_REASON_CANCELLED: FinishReason.CANCELLED}


# A request's Decode: its own stream, or its part of the worker's shared DecodeMany stream.
DecodeCall = Union[grpc.aio.StreamStreamCall, MuxedDecodeCall]
# Picks a ready decode worker other than those given; None when there is none.
PickDecode = Callable[[set[WorkerClient]], Awaitable[WorkerClient | None]]


@dataclass
class DecodeRoute:
    """Where a request's Decode goes: the worker, the start it is sent, the workers that refused the request, and
    how many times it migrated."""

    worker: WorkerClient
    start: worker_pb2.DecodeStart
    refused_by: set[WorkerClient] = field(default_factory=set)
    migrations: int = 0


class DecodeStream:
    def __init__(self, pool: WorkerPool, pick_decode: PickDecode, migration_limit: int, shared_streams: bool = True):
        self._pool = pool
        self._shared_streams = shared_streams
        self._pick_decode = pick_decode
        self._migration_limit = migration_limit

    async def events(self, flight: Flight, route: DecodeRoute) -> AsyncIterator[DecodeEvent]:
        """One decode worker's stream as plain events, ending with DecodeFinished. Raises DecodeInterrupted when the
        worker is UNAVAILABLE (then `reroute`); reads the flight (what the client was sent), never writes it."""
        worker, start, req = route.worker, route.start, flight.prepared
        handoff = start.HasField("session")
        session = flight.session if handoff else None
        span = tracing.tracer().start_span("decode", attributes={
            "disagg.worker": worker.endpoint, "disagg.kv_handoff": handoff})
        with trace.use_span(span, end_on_exit=False):  # the call's client span (and the worker's) hang under it
            timeout_s = flight.deadline.remaining_s()
            call = (worker.decode_mux.request(timeout_s) if self._shared_streams
                    else worker.decoder.Decode(timeout=timeout_s))
        delivered_before = flight.sent.completion_tokens
        # This worker's timings are the TTFT breakdown's: it runs the prompt, or it continues a KV handoff
        # (not a migration's or a continuation's recompute).
        timed = handoff or delivered_before == 0
        answered = False
        try:
            await _write(call, worker_pb2.DecodeClientMessage(start=start))
            async for message in call:
                if not answered and session is not None:
                    session.taken()  # until now the flight releases it if this stream fails
                answered = True
                if message.HasField("finished"):
                    for event in _worker_finished(message.finished, handoff, timed):
                        yield event
                    return
                delta = message.delta
                yield Tokens(delta.token_ids, delta.logprobs, delta.index, delta.prompt_logprobs)
                for index in flight.sent.stopped_choices():  # n > 1: that choice alone stops; the others go on
                    await _cancel_choice(call, index)
                if flight.sent.stopped:  # a stop string: the worker generates on until told
                    finished = await _cancelled(call)
                    for event in _usage(finished, handoff, timed) if finished is not None else ():
                        yield event
                    yield DecodeFinished(FinishReason.STOP)
                    return
            raise Unavailable(f"decode worker {worker.endpoint} ended request {req.request_id} without finishing it, "
                              f"after {flight.sent.completion_tokens} tokens were delivered")
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not _UNAVAILABLE:
                raise
            self._pool.mark_down(worker, exc.details())
            if not answered:
                raise _DecodeRefused(exc) from None
            raise _DecodeLost(exc.details()) from None
        finally:
            await _end_call(call)
            span.set_attribute("disagg.decode.tokens", flight.sent.completion_tokens - delivered_before)
            span.end()

    async def reroute(self, flight: Flight, route: DecodeRoute, interrupted: DecodeInterrupted) -> None:
        """Send the request to another decode worker: one that refused it before answering passes the same start
        (KV session included) on; one lost mid-stream is replaced (up to --migration-limit times) by one that
        continues from the prompt and the tokens delivered so far. Raises the request's error when there is none."""
        req, worker, delivered = flight.prepared, route.worker, flight.sent.completion_tokens
        if isinstance(interrupted, _DecodeRefused):
            route.refused_by.add(worker)
            other = await self._pick_decode(route.refused_by)
            if other is None:
                raise interrupted.error from None
            log.info("request %s: decode worker %s refused it (%s); sending it to %s", req.request_id,
                     worker.endpoint, interrupted.error.details(), other.endpoint)
            route.worker = other
            return
        # A migration continues one choice from its tokens: a request with several choices is not migrated.
        movable = route.migrations < self._migration_limit and req.params.n == 1
        other = await self._pick_decode({worker}) if movable else None
        if other is None:
            raise Unavailable(f"decode worker {worker.endpoint} failed during request {req.request_id} "
                              f"after {delivered} tokens were delivered ({interrupted}); retry the request") from None
        log.warning("request %s: decode worker %s lost after %d tokens (%s); migrating to %s",
                    req.request_id, worker.endpoint, delivered, interrupted, other.endpoint)
        route.worker, route.start = other, continuation_start(req, flight.sent.token_ids)
        route.migrations += 1


def aggregated_start(req: PreparedRequest) -> worker_pb2.DecodeStart:
    sampling, stop, output = sampling_to_proto(req.params)
    return worker_pb2.DecodeStart(request_id=req.worker_request_id, token_ids=req.prompt, sampling=sampling,
                                  stop=worker_stop_conditions(stop), output=output)


def handoff_start(req: PreparedRequest, first_token: int, session: common_pb2.KvSessionRef,
                  choices: dict[int, int] | None = None) -> worker_pb2.DecodeStart:
    """`choices` (n > 1): the first token of each choice still running, by index; first_token is then unused."""
    start = aggregated_start(req)
    start.sampling.ClearField("prompt_logprobs")  # prefill sent them
    if choices:
        first_token, *more = choices.values()
        start.choice_indices.extend(choices)
        start.more_first_tokens.extend(more)
    start.first_token = first_token
    start.session.CopyFrom(session)
    return start


def continuation_start(req: PreparedRequest, generated: list[int]) -> worker_pb2.DecodeStart:
    """Decode continues aggregated from the prompt and the tokens already delivered: after a prefill that
    ended the request where the router does not (it cannot know ignore_eos or stop token ids), or on
    another decode worker after a migration. Greedy output is the same; a seeded sampler's stream restarts."""
    start = aggregated_start(req)
    start.token_ids.extend(generated)
    if req.params.max_tokens is not None:
        start.sampling.max_tokens = req.params.max_tokens - len(generated)
    return start


def _worker_finished(finished: common_pb2.Finished, handoff: bool, timed: bool) -> list[DecodeEvent]:
    stop_id = finished.matched_stop_token_id if finished.HasField("matched_stop_token_id") else None
    choices = tuple((c.index, _FINISH_REASONS.get(c.reason, FinishReason.STOP),
                     c.matched_stop_token_id if c.HasField("matched_stop_token_id") else None)
                    for c in finished.choices)
    return [*_usage(finished, handoff, timed),
            DecodeFinished(_FINISH_REASONS.get(finished.reason, FinishReason.STOP), stop_id, choices)]


def _usage(finished: common_pb2.Finished, handoff: bool, timed: bool) -> list[DecodeEvent]:
    usage = finished.usage
    events: list[DecodeEvent] = [WorkerTimings(usage.ttft_breakdown)] if timed else []
    if not handoff:
        events.append(CachedTokens(usage.cached_prompt_tokens))
    else:  # how the KV came to decode, for the client's Finished.usage
        transport = name_of(usage.kv_transfer_backend) if usage.kv_transfer_backend else ""
        events.append(KvHandoff(transport, usage.kv_transfer_bytes, usage.kv_transfer_ms))
    return events


async def _cancelled(call: DecodeCall) -> common_pb2.Finished | None:
    """Cancel the worker's request on its Decode stream and wait for its Finished: by then its blocks are free.
    None when the worker does not confirm in time or the stream breaks (cancelling the RPC frees them too)."""
    try:
        async with asyncio.timeout(_CANCEL_ACK_TIMEOUT_S):
            with contextlib.suppress(asyncio.InvalidStateError):  # the worker has ended the stream already
                await _write(call, worker_pb2.DecodeClientMessage(cancel=common_pb2.Cancel()))
            async for message in call:
                if message.HasField("finished"):
                    return message.finished
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, TimeoutError) as exc:
        log.debug("decode worker did not confirm a cancel: %s", exc)
    return None


async def _cancel_choice(call: DecodeCall, index: int) -> None:
    """Ask the worker to stop one choice. Best effort: the worker may have ended the stream already (every choice
    done), and a stream that broke says so at the next read."""
    try:
        await _write(call, worker_pb2.DecodeClientMessage(cancel=common_pb2.Cancel(index=index)))
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
        log.debug("choice %d's cancel not written: %s", index, exc)


async def _write(call: DecodeCall, message: worker_pb2.DecodeClientMessage) -> None:
    """call.write, with this task's cancellation kept a cancellation: a call with interceptors (tracing on) turns a
    CancelledError that lands while the call is still being set up into InvalidStateError ("RPC already
    finished"), which would end a request its client cancelled as an internal error."""
    try:
        await call.write(message)
    except asyncio.InvalidStateError:
        if asyncio.current_task().cancelling():
            raise asyncio.CancelledError() from None
        raise


async def _end_call(call: DecodeCall) -> None:
    """Cancel the call, or half-close it when the worker has ended it already: with interceptors (tracing on) the
    call's writes go through a task that waits for the next one until the call is cancelled or half-closed, and
    a call that is over is neither, so that task would wait forever ("Task was destroyed but it is pending!")."""
    if not call.cancel():
        with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.UsageError):
            await call.done_writing()


class DecodeInterrupted(Exception):
    """The decode worker was UNAVAILABLE: DecodeStream.reroute sends the request on to another one."""


class _DecodeLost(DecodeInterrupted):
    """The decode worker went away (UNAVAILABLE) after it had started streaming."""


class _DecodeRefused(DecodeInterrupted):
    """The decode worker was UNAVAILABLE before it answered anything (draining, loading, gone): the request, and
    the KV session with it, are still the router's to send elsewhere."""

    def __init__(self, error: grpc.aio.AioRpcError):
        super().__init__(error.details())
        self.error = error

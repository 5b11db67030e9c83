"""A request's Flight: the event stream a front door iterates, how it ends early (cancel, end, the consumer
leaving) with its loop's cleanup run and its outcome counted once, and the decode events it applies."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from common.errors import Unavailable
from common.pb.disagg.v1 import common_pb2
from common.telemetry.metrics import Metrics
from services.router.deadline import Deadline
from services.router.decode_events import CachedTokens, DecodeFinished, KvHandoff, Tokens, WorkerTimings
from services.router.flight import Flight
from services.router.generation import Finished, FinishReason, GenerationRequest, TextDelta, Usage
from services.router.responses import ResponseBuilder


class Loop:
    """A stand-in for the orchestrator's loop: one delta, then a worker call that never answers."""

    def __init__(self) -> None:
        self.started = False
        self.freed = False

    async def __call__(self, flight: Flight):
        self.started = True
        try:
            yield TextDelta(token_ids=(1,), text="a")
            await asyncio.sleep(3600)
        finally:
            self.freed = True


def _flight(loop) -> tuple[Flight, Metrics]:
    metrics = Metrics.create("router", "m")
    sent = ResponseBuilder("r", None, metrics=metrics)
    return Flight(GenerationRequest("r", prompt="x"), sent, Deadline(None, 0), loop), metrics


def _counted(metrics: Metrics) -> dict[str, float]:
    """disagg_requests_total by status."""
    labels = {"model": "m", "role": "router"}
    return {status: value for status in ("OK", "CANCELLED", "UNAVAILABLE")
            if (value := metrics.registry.get_sample_value("disagg_requests_total", {**labels, "status": status}))}


async def _consume(flight: Flight, events: list, hold_s: float = 0.0) -> None:
    async with contextlib.aclosing(flight):
        async for event in flight:
            events.append(event)
            await asyncio.sleep(hold_s)  # a front door writing the event to its client


def test_cancel_while_the_loop_waits_ends_with_cancelled_and_frees_what_the_loop_holds():
    async def scenario():
        loop = Loop()
        flight, metrics = _flight(loop)
        events: list = []
        consumer = asyncio.create_task(_consume(flight, events))
        await asyncio.sleep(0.05)
        flight.cancel()
        await consumer
        return loop, events, metrics, consumer

    loop, events, metrics, consumer = asyncio.run(scenario())
    assert [type(e) for e in events] == [TextDelta, Finished] and events[-1].reason is FinishReason.CANCELLED
    assert loop.freed and not consumer.cancelled() and _counted(metrics) == {"CANCELLED": 1}


def test_cancel_while_the_consumer_holds_an_event_ends_the_stream_at_its_next_event():
    async def scenario():
        loop = Loop()
        flight, metrics = _flight(loop)
        events: list = []
        consumer = asyncio.create_task(_consume(flight, events, hold_s=0.1))
        await asyncio.sleep(0.05)
        flight.cancel()
        await consumer
        return loop, events, metrics

    loop, events, metrics = asyncio.run(scenario())
    assert events[-1].reason is FinishReason.CANCELLED and len(events) == 2 and loop.freed
    assert _counted(metrics) == {"CANCELLED": 1}


def test_a_flight_cancelled_before_its_first_event_never_starts_its_loop():
    async def scenario():
        loop = Loop()
        flight, _ = _flight(loop)
        flight.cancel()
        events: list = []
        await _consume(flight, events)
        return loop, events

    loop, events = asyncio.run(scenario())
    assert not loop.started and [e.reason for e in events] == [FinishReason.CANCELLED]


def test_end_raises_its_error_to_the_consumer_and_counts_it():
    async def scenario():
        loop = Loop()
        flight, metrics = _flight(loop)
        consumer = asyncio.create_task(_consume(flight, []))
        await asyncio.sleep(0.05)
        flight.end(Unavailable("router r:1 draining"))
        with pytest.raises(Unavailable, match="draining"):
            await consumer
        return loop, metrics

    loop, metrics = asyncio.run(scenario())
    assert loop.freed and _counted(metrics) == {"UNAVAILABLE": 1}


def test_a_consumer_that_leaves_cancels_the_request_even_when_cancel_was_asked_too():
    async def scenario():
        loop = Loop()
        flight, metrics = _flight(loop)
        consumer = asyncio.create_task(_consume(flight, []))
        await asyncio.sleep(0.05)
        flight.cancel()
        consumer.cancel()  # the client went away at the same moment
        with pytest.raises(asyncio.CancelledError):
            await consumer
        return loop, metrics

    loop, metrics = asyncio.run(scenario())
    assert loop.freed and _counted(metrics) == {"CANCELLED": 1}


def test_cancel_after_the_finished_event_changes_nothing():
    async def finishes(flight: Flight):
        yield Finished(reason=FinishReason.STOP, usage=Usage())

    async def scenario():
        flight, _ = _flight(finishes)
        events = []
        async with contextlib.aclosing(flight):
            async for event in flight:
                events.append(event)
                flight.cancel()
        return events

    assert [e.reason for e in asyncio.run(scenario())] == [FinishReason.STOP]


def test_decode_events_become_the_client_events_and_usage():
    flight, _ = _flight(Loop())
    assert flight.apply(CachedTokens(3)) == [] and flight.apply(KvHandoff("shm", 4096, 1.5)) == []
    assert flight.apply(WorkerTimings(common_pb2.TtftBreakdown(kv_handoff_ms=2.0))) == []
    (delta,) = flight.apply(Tokens([7, 8]))
    assert delta.token_ids == (7, 8)
    (finished,) = flight.apply(DecodeFinished(FinishReason.STOP, stop_token_id=2))
    usage = finished.usage
    assert finished.matched_stop_token_id == 2 and usage.completion_tokens == 2 and usage.cached_prompt_tokens == 3
    assert (usage.kv_transfer_backend, usage.kv_transfer_bytes, usage.kv_transfer_ms) == ("shm", 4096, 1.5)
    assert usage.ttft_breakdown.kv_handoff_ms == 2.0

"""Deltas that pile up while a stream's last write is under way leave as one message (the router's front door:
services/router/frontends/coalesce.py; the decode worker's Decode stream: services/decode/server.py), and only
those: a consumer that keeps up gets every delta alone, in order, with nothing lost or reordered."""
from __future__ import annotations

import asyncio

import pytest

from common.pb.disagg.v1 import common_pb2, worker_pb2
from services.decode.server import _NOTHING, _merge_waiting
from services.router.frontends.coalesce import coalesced, merged
from services.router.generation import Finished, FinishReason, TextDelta, TokenLogprob, Usage


def _delta(*tokens: int, index: int = 0, **kw) -> TextDelta:
    return TextDelta(token_ids=tokens, text="".join(f"<{t}>" for t in tokens), index=index, **kw)


def test_merged_joins_tokens_text_and_logprobs_of_one_choice_only():
    a = _delta(1, logprobs=(TokenLogprob(1, -0.5, "<1>"),), prompt_token_ids=(7, 8))
    b = _delta(2, 3, logprobs=(TokenLogprob(2, -1.0, "<2>"), TokenLogprob(3, -2.0, "<3>")))
    both = merged(a, b)
    assert both == TextDelta(token_ids=(1, 2, 3), text="<1><2><3>", logprobs=a.logprobs + b.logprobs,
                             prompt_token_ids=(7, 8))
    assert merged(a, _delta(2, index=1)) is None  # another choice
    assert merged(a, _delta(2, prompt_token_ids=(7,))) is None  # a choice's first delta stays first


async def _collect(source, *, slow_consumer_s: float = 0.0) -> list:
    out = []
    async for event in coalesced(source):
        out.append(event)
        await asyncio.sleep(slow_consumer_s)  # the client write
    return out


def test_a_consumer_that_keeps_up_gets_every_delta_alone():
    async def source():
        for t in range(5):
            yield _delta(t)
            await asyncio.sleep(0.005)  # a decode step
        yield Finished(FinishReason.LENGTH, Usage())

    events = asyncio.run(_collect(source()))
    assert [e.token_ids for e in events[:-1]] == [(t,) for t in range(5)]
    assert isinstance(events[-1], Finished)


def test_deltas_that_pile_up_during_a_slow_write_leave_merged_in_order():
    async def source():
        for t in range(12):
            yield _delta(t, index=t % 2 if t >= 6 else 0)
            await asyncio.sleep(0.001)
        yield Finished(FinishReason.LENGTH, Usage())

    events = asyncio.run(_collect(source(), slow_consumer_s=0.004))
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert len(deltas) < 12  # fewer writes than tokens
    for index in (0, 1):  # every token of each choice, once, in order
        assert [t for d in deltas if d.index == index for t in d.token_ids] == \
            [t for t in range(12) if (t % 2 if t >= 6 else 0) == index]
    assert isinstance(events[-1], Finished)


def test_an_error_of_the_events_is_raised_after_what_came_before_it():
    async def source():
        yield _delta(1)
        raise RuntimeError("decode worker lost")

    async def run():
        got = []
        with pytest.raises(RuntimeError, match="decode worker lost"):
            async for event in coalesced(source()):
                got.append(event)
        return got

    assert [e.token_ids for e in asyncio.run(run())] == [(1,)]


def test_closing_early_stops_the_reading_and_closes_the_events():
    closed = asyncio.Event()

    async def source():
        try:
            yield _delta(1)
            await asyncio.sleep(3600)  # a request still decoding
        finally:
            closed.set()

    async def run():
        stream = coalesced(source())
        assert (await anext(stream)).token_ids == (1,)
        await asyncio.sleep(0.01)
        await stream.aclose()  # the client left
        assert closed.is_set()

    asyncio.run(run())


def _message(*tokens: int, index: int = 0, prompt_logprobs: bool = False) -> worker_pb2.DecodeServerMessage:
    delta = common_pb2.Delta(token_ids=tokens, index=index,
                             logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=-1.0) for t in tokens])
    if prompt_logprobs:
        delta.prompt_logprobs.append(common_pb2.TokenLogprob(token_id=9, logprob=-3.0))
    return worker_pb2.DecodeServerMessage(request_id="r", delta=delta)


def test_the_decode_worker_merges_the_waiting_deltas_of_one_choice_and_keeps_the_rest_next():
    outbox: asyncio.Queue = asyncio.Queue()
    finished = worker_pb2.DecodeServerMessage(request_id="r", finished=common_pb2.Finished())
    for item in (_message(2), _message(3, 4), _message(5, index=1), _message(6)):
        outbox.put_nowait(item)
    message, held = _merge_waiting(_message(1), outbox)
    assert list(message.delta.token_ids) == [1, 2, 3, 4]
    assert [lp.token_id for lp in message.delta.logprobs] == [1, 2, 3, 4]
    assert held.delta.index == 1 and outbox.qsize() == 1  # the other choice's delta goes next, alone

    outbox.put_nowait(finished)
    message, held = _merge_waiting(_message(7), outbox)
    assert list(message.delta.token_ids) == [7, 6] and held is finished  # the end is never merged into a delta
    assert _merge_waiting(finished, asyncio.Queue()) == (finished, _NOTHING)
    empty: asyncio.Queue = asyncio.Queue()
    empty.put_nowait(_message(8, prompt_logprobs=True))
    message, held = _merge_waiting(_message(7), empty)
    assert list(message.delta.token_ids) == [7] and list(held.delta.token_ids) == [8]

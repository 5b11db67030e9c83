"""KV events from the engine's prefix cache: snapshot, stored with chained hashes, removed on eviction, gaps."""
import asyncio

from common.kv.block_hash import hash_blocks
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from common.kv import events as kv_events

ONE = SamplingParams(temperature=0, max_tokens=1)


def _engine(path, blocks=16) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, block_size=4, num_kv_blocks=blocks))


def _drain(subscriber) -> list:
    items = []
    while not subscriber.queue.empty():
        items.append(subscriber.queue.get_nowait())
    return items


def test_snapshot_then_live_stored_and_removed_events(tiny_llama):
    engine = _engine(tiny_llama)
    first = list(range(3, 20))  # 17 tokens: 4 full blocks
    engine.generate([first], ONE)

    async def main():
        loop = asyncio.get_running_loop()
        subscriber = engine.kv_events.subscribe(loop)
        await asyncio.sleep(0)
        snapshot = _drain(subscriber)
        engine.generate([list(range(100, 149))], ONE)  # 49 tokens: needs blocks the first prompt left cached
        await asyncio.sleep(0)
        return snapshot, _drain(subscriber)

    snapshot, live = asyncio.run(main())
    expected = hash_blocks(first, 4)
    assert [seq for seq, _ in snapshot] == list(range(1, 6))
    assert snapshot[0][1] == ("cleared",)
    assert {body[1][0] for _, body in snapshot[1:]} == set(expected)
    assert {body[2] for _, body in snapshot[1:]} == {None, *expected[:-1]}  # each block's parent
    assert [seq for seq, _ in live] == list(range(6, 6 + len(live)))  # +1 per event
    removed = [h for _, body in live if body[0] == "removed" for h in body[1]]
    stored = [body for _, body in live if body[0] == "stored"]
    assert set(removed) <= set(expected) and removed  # eviction of the first prompt's blocks
    assert stored[0][1] == hash_blocks(list(range(100, 149)), 4)[: len(stored[0][1])] and stored[0][2] is None
    assert stored[0][3] == 4 * len(stored[0][1])


def test_a_full_queue_drops_events_and_leaves_a_gap(tiny_llama, monkeypatch):
    monkeypatch.setattr(kv_events, "QUEUE_LIMIT", 1)  # room: the (1-message) snapshot + 1 live event
    engine = _engine(tiny_llama, blocks=64)

    async def main():
        subscriber = engine.kv_events.subscribe(asyncio.get_running_loop())  # 1: cleared (empty cache)
        for i in range(3):  # 2, 3, 4: one stored event each; 3 and 4 do not fit
            engine.generate([list(range(10 + 20 * i, 30 + 20 * i))], ONE)
        await asyncio.sleep(0)
        first = _drain(subscriber)
        engine.generate([list(range(200, 220))], ONE)  # 5
        await asyncio.sleep(0)
        return first, _drain(subscriber)

    first, later = asyncio.run(main())
    assert [seq for seq, _ in first] == [1, 2] and [seq for seq, _ in later] == [5]  # the gap says: resubscribe
    assert engine.kv_events.num_cached == 20  # the log itself saw every block

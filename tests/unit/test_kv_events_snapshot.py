"""A snapshot larger than the live-event bound still arrives whole (no self-inflicted gap)."""
import asyncio

from common.kv.block_hash import hash_blocks
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from common.kv import events as kv_events


def test_a_snapshot_bigger_than_the_queue_bound_has_no_gap(tiny_llama, monkeypatch):
    # A GPU worker caches tens of thousands of blocks; the bound is for live events a slow
    # subscriber falls behind on, not for the snapshot, which would otherwise gap every time.
    monkeypatch.setattr(kv_events, "QUEUE_LIMIT", 2)
    engine = LLMEngine(EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=32))
    prompt = list(range(10, 35))  # 25 tokens: 6 full blocks
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))

    async def main():
        subscriber = engine.kv_events.subscribe(asyncio.get_running_loop())
        await asyncio.sleep(0)
        return [subscriber.queue.get_nowait() for _ in range(subscriber.queue.qsize())]

    snapshot = asyncio.run(main())
    assert [seq for seq, _ in snapshot] == list(range(1, 8))
    assert [body[1][0] for _, body in snapshot[1:]] == hash_blocks(prompt, 4)

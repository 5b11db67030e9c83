"""The router's KV index: engine hashes match the router's, gaps and broken streams resubscribe,
and kv_aware's cost weighs cached blocks against queued prefill."""
import asyncio
from functools import partial

import grpc

from common.discovery import Role
from common.kv.block_hash import hash_blocks
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from common.pb.disagg.v1 import worker_pb2, worker_pb2_grpc
from services.kit.convert import kv_event_to_proto
from services.router import kv_index as kv_index_module
from services.router.kv_index import KvIndex
from services.router.policies.kv_aware import KvAware, KvAwareWeights
from services.router.workers import WorkerClient
from tests.loopback_grpc import loopback_server


def _stored(seq: int, hashes: list[int]) -> worker_pb2.KvEvent:
    return kv_event_to_proto(seq, ("stored", hashes, None, 4 * len(hashes)), "w")


def _client(endpoint: str, block_size: int = 4) -> WorkerClient:
    return WorkerClient(Role.PREFILL, endpoint, grpc.aio.insecure_channel(endpoint),
                        info=worker_pb2.WorkerInfo(block_size=block_size))


def test_index_follows_stored_removed_cleared_and_counts_only_a_leading_run():
    index = KvIndex()
    index.apply("a", _stored(1, [1, 2, 3]))
    assert index.overlap_blocks("a", [1, 2, 3, 9]) == 3
    assert index.overlap_blocks("a", [9, 2, 3]) == 0  # a chained hash only counts from the start
    index.apply("a", kv_event_to_proto(2, ("removed", [2]), "w"))
    assert index.overlap_blocks("a", [1, 2, 3]) == 1
    index.apply("a", kv_event_to_proto(3, ("cleared",), "w"))
    assert index.num_blocks("a") == 0 and index.overlap_blocks("b", [1]) == 0


def test_the_router_hashes_a_prompt_as_the_engine_caches_it(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=32))
    system = list(range(50, 73))  # 23 tokens: 5 full blocks cached
    engine.generate([system], SamplingParams(temperature=0, max_tokens=1))

    async def snapshot() -> list:
        subscriber = engine.kv_events.subscribe(asyncio.get_running_loop())
        await asyncio.sleep(0)
        return [subscriber.queue.get_nowait() for _ in range(subscriber.queue.qsize())]

    index = KvIndex()
    for seq, body in asyncio.run(snapshot()):
        index.apply("w", kv_event_to_proto(seq, body, "w"))
    follow_up = system[:20] + [400, 401, 402, 403, 404]
    assert index.overlap_blocks("w", hash_blocks(follow_up, 4)) == 5
    assert engine.block_manager.num_free_blocks == 32  # nothing else held


class _ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """Subscription 1 skips sequence 3 (a dropped event); subscription 2 is a clean snapshot."""

    def __init__(self) -> None:
        self.subscriptions = 0

    async def SubscribeKvEvents(self, request, context):
        self.subscriptions += 1
        if self.subscriptions == 1:
            for event in (kv_event_to_proto(1, ("cleared",), "w"), _stored(2, [11]), _stored(4, [99])):
                yield event
        else:
            yield kv_event_to_proto(1, ("cleared",), "w")
            yield _stored(2, [11, 12])
        await asyncio.Event().wait()  # live: nothing more happens


def test_a_sequence_gap_drops_the_entry_and_resubscribes_to_a_snapshot(monkeypatch):
    monkeypatch.setattr(kv_index_module, "_RETRY_S", (0.01, 0.05))

    async def main():
        servicer = _ScriptedWorker()
        async with loopback_server(partial(worker_pb2_grpc.add_WorkerServicer_to_server, servicer)) as (_, address):
            index = KvIndex()
            worker = _client(address)
            try:
                index.follow(worker)
                for _ in range(200):
                    if servicer.subscriptions >= 2 and index.num_blocks(worker.endpoint) == 2:
                        break
                    await asyncio.sleep(0.01)
                return servicer.subscriptions, index.overlap_blocks(worker.endpoint, [11, 12, 99])
            finally:
                await index.close()
                await worker.channel.close()

    subscriptions, overlap = asyncio.run(main())
    assert subscriptions == 2 and overlap == 2  # 99 (after the gap) was never applied


def test_kv_aware_prefers_the_cached_worker_until_its_queue_outweighs_the_hit():
    async def main():
        index = KvIndex()
        hot, cold = _client("127.0.0.1:1"), _client("127.0.0.1:2")
        prompt = list(range(100, 140))  # 10 blocks
        index.apply(hot.endpoint, _stored(1, hash_blocks(prompt[:32], 4)))  # 8 of them cached on `hot`
        index.follow = lambda worker: None  # no subscriptions in this test: the index is fed above
        policy = KvAware(index, KvAwareWeights(overlap=1.0, load=1.0))
        picks = [(await policy.pick([hot, cold], prompt)).endpoint]
        assert policy.cached_tokens(hot, prompt) == 32 and policy.cost(hot, prompt) == 2
        hot.pending_prefill_tokens = 7 * 4  # 7 blocks queued: 2 + 7 < 10, still worth it
        picks.append((await policy.pick([hot, cold], prompt)).endpoint)
        hot.pending_prefill_tokens = 9 * 4  # 2 + 9 > 10: the idle worker wins
        picks.append((await policy.pick([hot, cold], prompt)).endpoint)
        for w in (hot, cold):
            await w.channel.close()
        return picks

    assert asyncio.run(main()) == ["127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:2"]


def test_a_lower_tiers_block_counts_below_a_device_block_by_its_reported_hit_cost():
    """Blocks a worker holds on disk or in host memory (its tiers' events) count in the leading run, each 1 - the
    hit cost the worker reported for its tier (DEFAULT_HIT_COST before any); a block counts where it is best; a
    miss ends the run; removing it from one tier leaves it in another."""
    index = KvIndex()
    index.apply("a", kv_event_to_proto(1, ("stored", [1, 2], None, 8, "device"), "w"))
    index.apply("a", kv_event_to_proto(2, ("stored", [2, 3, 4], 1, 12, "disk"), "w"))
    assert index.overlap_blocks("a", [1, 2, 3, 4, 9]) == 1 + 1 + 2 * (1 - kv_index_module.DEFAULT_HIT_COST)
    index.apply("a", kv_event_to_proto(3, ("hit_cost", "disk", 0.2), "w"))
    assert abs(index.overlap_blocks("a", [1, 2, 3, 4]) - (2 + 2 * 0.8)) < 1e-6
    index.apply("a", kv_event_to_proto(4, ("removed", [2], "device"), "w"))  # evicted to disk: still there
    assert abs(index.overlap_blocks("a", [1, 2, 3]) - (1 + 2 * 0.8)) < 1e-6
    index.apply("a", kv_event_to_proto(5, ("hit_cost", "disk", 7.0), "w"))  # a bogus cost stays below a miss
    assert 0 < index.overlap_blocks("a", [2]) < 1
    index.apply("a", kv_event_to_proto(6, ("cleared",), "w"))
    assert index.overlap_blocks("a", [1]) == 0 and index.num_blocks("a", worker_pb2.KV_TIER_DISK) == 0


def test_kv_aware_prefers_a_device_hit_to_a_disk_hit_to_a_miss():
    async def main():
        index = KvIndex()
        policy = KvAware(index, KvAwareWeights(overlap=1.0, load=1.0))
        on_device, on_disk, cold = _client("device:1"), _client("disk:1"), _client("cold:1")
        prompt = list(range(32))  # 8 blocks of 4
        hashes = hash_blocks(prompt, 4)
        index.apply(on_device.endpoint, kv_event_to_proto(1, ("stored", hashes, None, 32), "w"))
        index.apply(on_disk.endpoint, kv_event_to_proto(1, ("stored", hashes, None, 32, "disk"), "w"))
        index.apply(on_disk.endpoint, kv_event_to_proto(2, ("hit_cost", "disk", 0.25), "w"))
        costs = [policy.cost(w, prompt) for w in (on_device, on_disk, cold)]
        assert costs == [0, 2, 8], costs
        assert await policy.pick([cold, on_disk, on_device], prompt) is on_device
        assert await policy.pick([cold, on_disk], prompt) is on_disk
        assert policy.cached_tokens(on_disk, prompt) == 24
        for worker in (on_device, on_disk, cold):
            await worker.channel.close()

    asyncio.run(main())


def test_the_event_log_snapshots_every_tier_and_the_hit_costs():
    """A subscriber's snapshot holds the device's blocks, each tier's and the last hit cost of each, in the numbered
    order a live stream would have given them; emptying the device cache leaves the tiers' blocks announced."""
    from common.kv.events import KvEventLog

    async def main():
        log = KvEventLog(block_size=4)
        log.stored([1, 2], None)
        log.stored([3], 2, tier="disk")
        log.hit_cost("disk", 0.3)
        subscriber = log.subscribe(asyncio.get_running_loop())
        log.cleared()
        await asyncio.sleep(0)
        bodies = []
        while not subscriber.queue.empty():
            bodies.append((await subscriber.queue.get())[1])
        return bodies, log

    bodies, log = asyncio.run(main())
    assert bodies == [("cleared",), ("stored", [1], None, 4, "device"), ("stored", [2], 1, 4, "device"),
                      ("stored", [3], 2, 4, "disk"), ("hit_cost", "disk", 0.3),
                      ("cleared",), ("stored", [3], 2, 4, "disk")]
    assert log.num_cached == 0 and log.num_in("disk") == 1
    events = [kv_event_to_proto(i, body, "w") for i, body in enumerate(bodies, 1)]
    index = KvIndex()
    for event in events:
        index.apply("w", event)
    assert index.num_blocks("w", worker_pb2.KV_TIER_DISK) == 1 and index.num_blocks("w") == 0
    assert abs(index.hit_cost("w", worker_pb2.KV_TIER_DISK) - 0.3) < 1e-6

"""Remote prefill or local on the decode worker: the rule (decide) and the numbers the router feeds it."""
import asyncio

import grpc
import pytest

from common.discovery import Role
from common.kv.block_hash import hash_blocks
from common.errors import InvalidConfig
from common.pb.disagg.v1 import worker_pb2
from common.telemetry.metrics import Metrics
from services.kit.convert import kv_event_to_proto
from services.router.config import RouterConfig
from services.router.disagg_decision import (
    LOCAL_REASONS, REMOTE_REASONS, DecodeLoad, Demand, DisaggConfig, PrefillPlacement, PrefillQueue, decide,
)
from services.router.kv_index import KvIndex
from services.router.policies.kv_aware import KvAware
from services.router.workers import WorkerClient

CONFIG = DisaggConfig(min_remote_prefill_tokens=16, max_local_prefill_tokens=64, max_prefill_queue_tokens=1000)
EMPTY_QUEUE = PrefillQueue(router_tokens=0, router_requests=0, waiting_requests=0)
FULL_QUEUE = PrefillQueue(router_tokens=1000, router_requests=2, waiting_requests=0)
IDLE_DECODE = DecodeLoad(running_requests=1, waiting_requests=0, max_num_seqs=8)
BUSY_DECODE = DecodeLoad(running_requests=3, waiting_requests=2, max_num_seqs=8)


def _long(uncached: int = 500) -> Demand:
    return Demand(prompt_tokens=500, uncached_on_decode=uncached, uncached_on_prefill=uncached)


def test_a_long_uncached_prompt_goes_remote_while_the_prefill_queue_has_room():
    assert decide(CONFIG, _long(), EMPTY_QUEUE, IDLE_DECODE) == (True, "long_uncached")


def test_a_prompt_mostly_cached_on_the_decode_worker_prefills_there():
    demand = Demand(prompt_tokens=500, uncached_on_decode=40, uncached_on_prefill=500)
    assert decide(CONFIG, demand, EMPTY_QUEUE, IDLE_DECODE) == (False, "short_uncached")
    assert decide(CONFIG, _long(uncached=64), EMPTY_QUEUE, IDLE_DECODE) == (False, "short_uncached")
    assert decide(CONFIG, _long(uncached=65), EMPTY_QUEUE, IDLE_DECODE) == (True, "long_uncached")


def test_a_saturated_prefill_queue_sends_the_prompt_to_a_decode_worker_with_room():
    assert decide(CONFIG, _long(), FULL_QUEUE, IDLE_DECODE) == (False, "prefill_queue_full")
    just_under = PrefillQueue(router_tokens=999, router_requests=2)
    assert decide(CONFIG, _long(), just_under, IDLE_DECODE) == (True, "long_uncached")


def test_when_both_sides_are_busy_the_prompt_queues_on_the_prefill_worker():
    assert decide(CONFIG, _long(), FULL_QUEUE, BUSY_DECODE) == (True, "decode_busy")
    full_batch = DecodeLoad(running_requests=8, waiting_requests=0, max_num_seqs=8)
    assert decide(CONFIG, _long(), FULL_QUEUE, full_batch) == (True, "decode_busy")
    assert decide(CONFIG, _long(), FULL_QUEUE, None) == (True, "decode_busy")  # its load is unknown


def test_waiting_requests_of_other_routers_count_toward_the_queue():
    # This router queued 400 tokens in 1 request; the worker has 3 waiting: 2 are someone else's, of ~300 each.
    queue = PrefillQueue(router_tokens=400, router_requests=1, waiting_requests=3)
    assert queue.queued_tokens(incoming_tokens=300) == 1000
    assert decide(CONFIG, _long(uncached=300), queue, IDLE_DECODE) == (False, "prefill_queue_full")
    unknown = PrefillQueue(router_tokens=400, router_requests=1, waiting_requests=None)
    assert decide(CONFIG, _long(uncached=300), unknown, IDLE_DECODE) == (True, "long_uncached")


def test_min_remote_prefill_tokens_is_a_hard_floor():
    short = Demand(prompt_tokens=15, uncached_on_decode=15, uncached_on_prefill=15)
    config = DisaggConfig(min_remote_prefill_tokens=16)
    assert decide(config, short, EMPTY_QUEUE, BUSY_DECODE) == (False, "below_min_prompt")
    assert decide(config, Demand(16, 16, 16), EMPTY_QUEUE, BUSY_DECODE) == (True, "long_uncached")


def test_without_a_prefill_worker_every_prompt_runs_locally():
    assert decide(CONFIG, _long(), None, BUSY_DECODE) == (False, "no_prefill_worker")


def test_the_defaults_send_every_prompt_remote_whatever_the_load():
    # The behaviour before conditional disaggregation: no local threshold, no queue limit.
    for queue, decode in [(EMPTY_QUEUE, IDLE_DECODE), (FULL_QUEUE, IDLE_DECODE), (FULL_QUEUE, None)]:
        assert decide(DisaggConfig(), Demand(1, 1, 1), queue, decode) == (True, "long_uncached")


def test_a_decode_worker_reporting_no_batch_limit_has_room_while_nothing_waits():
    assert DecodeLoad(running_requests=50, waiting_requests=0, max_num_seqs=0).has_room
    assert not DecodeLoad(running_requests=50, waiting_requests=1, max_num_seqs=0).has_room


# --- PrefillPlacement: the numbers from the router's workers ---


class _FakeWorkerStub:
    def __init__(self, load: worker_pb2.Load | None):
        self.load = load
        self.calls = 0

    async def GetLoad(self, request, timeout=None):
        self.calls += 1
        if self.load is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, None, None, "stopped")
        return self.load

    async def SubscribeKvEvents(self, request):  # a live stream with nothing new: the test fills the index
        await asyncio.Event().wait()
        yield


def _worker(role: Role, endpoint: str, load: worker_pb2.Load | None) -> WorkerClient:
    info = worker_pb2.WorkerInfo(block_size=4, limits=worker_pb2.WorkerLimits(max_num_seqs=8))
    client = WorkerClient(role, endpoint, channel=grpc.aio.insecure_channel(endpoint), info=info, healthy=True)
    client.worker = _FakeWorkerStub(load)
    return client


def _decisions(metrics: Metrics) -> dict[tuple[str, str], float]:
    family = metrics._families["disagg_routing_prefill_decisions_total"]
    return {(s.labels["where"], s.labels["reason"]): s.value for m in family.collect() for s in m.samples
            if s.name.endswith("_total")}


def test_placement_counts_the_router_queue_and_asks_load_only_when_it_matters():
    metrics = Metrics.create("router", "tiny")
    placement = PrefillPlacement(DisaggConfig(max_local_prefill_tokens=8, max_prefill_queue_tokens=100),
                                 metrics=metrics)

    async def run() -> list[bool]:
        decode = _worker(Role.DECODE, "d:1", worker_pb2.Load(running_requests=1))
        prefill = _worker(Role.PREFILL, "p:1", None)  # does not answer GetLoad (stopped, say)

        async def remote(prompt_len: int) -> bool:
            async def pick() -> WorkerClient:
                return prefill

            return await placement.place(list(range(prompt_len)), decode, pick) is prefill

        placed = [await remote(8)]
        assert decode.worker.calls == prefill.worker.calls == 0  # short: the load cannot change the answer
        placed.append(await remote(50))
        with prefill.prefilling(100):  # another request's prefill in flight there
            placed.append(await remote(50))
            decode.worker.load = worker_pb2.Load(running_requests=1, waiting_requests=1)
            placed.append(await remote(50))
        return placed

    assert asyncio.run(run()) == [False, True, False, True]
    assert _decisions(metrics) == {("local", "short_uncached"): 1, ("remote", "long_uncached"): 1,
                                   ("local", "prefill_queue_full"): 1, ("remote", "decode_busy"): 1}


def test_under_kv_aware_the_decode_workers_cached_prefix_is_not_counted_as_uncached():
    kv = KvAware(KvIndex())
    placement = PrefillPlacement(DisaggConfig(max_local_prefill_tokens=8), kv)
    prompt = list(range(100, 140))  # 10 blocks of 4

    async def run() -> list[bool]:
        decode = _worker(Role.DECODE, "d:1", worker_pb2.Load())
        prefill = _worker(Role.PREFILL, "p:1", worker_pb2.Load())

        async def remote(tokens: list[int]) -> bool:
            async def pick() -> WorkerClient:
                return prefill

            return await placement.place(tokens, decode, pick) is prefill

        placed = [await remote(prompt)]  # nothing cached on decode: 40 uncached tokens
        kv.index.apply("d:1", kv_event_to_proto(1, ("stored", hash_blocks(prompt[:32], 4), None, 32), "d"))
        placed.append(await remote(prompt))  # 8 uncached: local
        placed.append(await remote(prompt[:32] + list(range(300, 309))))  # 9 uncached: remote
        return placed

    assert asyncio.run(run()) == [True, False, True]


def test_a_fully_cached_prompt_still_counts_its_last_token_so_the_defaults_stay_remote():
    kv = KvAware(KvIndex())
    placement = PrefillPlacement(DisaggConfig(), kv)
    prompt = list(range(100, 116))

    async def run() -> bool:
        decode = _worker(Role.DECODE, "d:1", worker_pb2.Load())
        prefill = _worker(Role.PREFILL, "p:1", worker_pb2.Load())
        kv.index.apply("d:1", kv_event_to_proto(1, ("stored", hash_blocks(prompt, 4), None, 16), "d"))

        async def pick() -> WorkerClient:
            return prefill

        return await placement.place(prompt, decode, pick) is prefill

    assert asyncio.run(run())


def test_every_reason_is_a_known_label_value():
    assert set(LOCAL_REASONS).isdisjoint(REMOTE_REASONS)
    cases = [(DisaggConfig(min_remote_prefill_tokens=10), Demand(5, 5, 5), EMPTY_QUEUE, IDLE_DECODE),
             (CONFIG, _long(), None, IDLE_DECODE), (CONFIG, _long(10), EMPTY_QUEUE, IDLE_DECODE),
             (CONFIG, _long(), FULL_QUEUE, IDLE_DECODE), (CONFIG, _long(), EMPTY_QUEUE, IDLE_DECODE),
             (CONFIG, _long(), FULL_QUEUE, BUSY_DECODE)]
    seen = {decide(*case) for case in cases}
    assert seen == {(False, r) for r in LOCAL_REASONS} | {(True, r) for r in REMOTE_REASONS}


@pytest.mark.parametrize("flag", ["max_local_prefill_tokens", "max_prefill_queue_tokens"])
def test_router_config_names_a_negative_flag(flag):
    with pytest.raises(InvalidConfig, match="--" + flag.replace("_", "-")):
        RouterConfig(model="m", **{flag: -1})


def test_an_overflowing_prompt_stays_remote_while_the_decode_worker_prefills_another_of_ours():
    """One local prefill at a time: a second overflow waits in the prefill queue rather than chunking beside the
    first on the decode GPU (both their TTFTs and every decode row's ITL would pay)."""
    config = DisaggConfig(max_prefill_queue_tokens=1000)
    demand = Demand(prompt_tokens=800, uncached_on_decode=800, uncached_on_prefill=800)
    saturated = PrefillQueue(router_tokens=1500, router_requests=2)
    prefilling = DecodeLoad(running_requests=1, waiting_requests=0, max_num_seqs=8, prefilling_tokens=900)
    assert not prefilling.has_room
    assert decide(config, demand, saturated, prefilling) == (True, "decode_busy")
    assert decide(config, demand, saturated, IDLE_DECODE) == (False, "prefill_queue_full")

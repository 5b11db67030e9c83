"""kv_aware routing with two real prefill workers: requests follow the cached prefix, stop following it
when the worker evicts it (BlockRemoved), re-sync after a restart, and still spread under load."""
from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import grpc
import pytest

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.leaks import assert_no_leaks
from tests.integration.processes import ServiceProcess, start_services, stop_in_waves

BLOCK = 4
SYSTEM = list(range(100, 164))  # a 64-token shared prefix: 16 blocks (the tiny model has 512 token ids)
ARGS = ("--block-size", str(BLOCK), "--num-kv-blocks", "48")
ENV = {"OMP_NUM_THREADS": "1"}
SETTLE_S = 1.0  # KV events reach the router asynchronously


def _question(i: int) -> list[int]:
    return [(7 * i + k) % 300 + 200 for k in range(6)]


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    workers = start_services([("prefill", ("--model", tiny_llama, *ARGS)), ("prefill", ("--model", tiny_llama, *ARGS)),
                              ("decode", ("--model", tiny_llama, *ARGS))], env=ENV)
    prefills = sorted(workers[:2], key=lambda p: p.address)  # ties go to the first endpoint
    router = start_services([("router", ("--model", tiny_llama, "--policy", "kv_aware",
                                         "--prefill-workers", ",".join(p.address for p in prefills),
                                         "--decode-workers", workers[2].address))], env=ENV)[0]
    state = {"prefills": prefills, "decode": workers[2], "router": router}
    try:
        yield state
    finally:
        stop_in_waves([router, *state["prefills"], workers[2]])


def _exported(process: ServiceProcess) -> int:
    text = urllib.request.urlopen(f"http://{process.metrics_address}/metrics", timeout=5).read().decode()
    match = re.search(r"^disagg_kv_sessions_exported_total\{[^}]*\} (\S+)$", text, re.M)
    return int(float(match[1])) if match else 0


def _generate(router: ServiceProcess, prompt: list[int]) -> common_pb2.Finished:
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt),
                                             sampling=common_pb2.SamplingParams(temperature=0, max_tokens=2),
                                             stop=common_pb2.StopConditions(ignore_eos=True))
    with router.channel() as channel:
        return list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))[-1].finished


def _served_by(cluster, prompt: list[int]) -> tuple[int, common_pb2.Finished]:
    """Which prefill worker (index in cluster["prefills"]) ran the request, and its Finished."""
    before = [_exported(p) for p in cluster["prefills"]]
    finished = _generate(cluster["router"], prompt)
    after = [_exported(p) for p in cluster["prefills"]]
    (index,) = [i for i in range(2) if after[i] > before[i]]
    return index, finished


def _prefill_directly(process: ServiceProcess, prompt: list[int]) -> None:
    """Fill a worker's prefix cache behind the router's back, leaving no session."""
    with process.channel() as channel:
        ready = worker_pb2_grpc.PrefillerStub(channel).Prefill(worker_pb2.PrefillRequest(
            token_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1)), timeout=30)
        worker_pb2_grpc.TensorStoreStub(channel).Release(worker_pb2.ReleaseRequest(handle=ready.session.session_id),
                                                         timeout=10)


_evictions = iter(range(1, 100))


def _evict_everything(process: ServiceProcess) -> None:
    """Two long prompts never seen before fill all 48 blocks, evicting whatever the cache held."""
    for i in range(2):
        first = next(_evictions)  # a new first token: no block of these prompts is cached anywhere
        _prefill_directly(process, [first] + list(range(3 + 130 * i, 122 + 130 * i)))


def test_requests_follow_the_cached_prefix_and_let_go_when_it_is_evicted(cluster):
    index, finished = _served_by(cluster, SYSTEM + _question(0))
    assert index == 0 and finished.usage.cached_prompt_tokens == 0  # cold: the tie goes to the first worker
    time.sleep(SETTLE_S)
    for i in range(1, 4):
        index, finished = _served_by(cluster, SYSTEM + _question(i))
        assert index == 0, f"request {i} left the worker holding its prefix"
        assert finished.usage.cached_prompt_tokens == len(SYSTEM)

    # Worker 0 evicts the prefix; worker 1 gets it.
    _evict_everything(cluster["prefills"][0])
    _prefill_directly(cluster["prefills"][1], SYSTEM + [7, 7, 7])
    time.sleep(SETTLE_S)
    index, finished = _served_by(cluster, SYSTEM + _question(4))
    assert index == 1, "the router still believed worker 0 held the prefix (BlockRemoved ignored)"
    assert finished.usage.cached_prompt_tokens == len(SYSTEM)


def test_a_restarted_worker_is_re_synced(cluster, tiny_llama):
    prefills = cluster["prefills"]
    _prefill_directly(prefills[1], SYSTEM + [8, 8, 8])
    time.sleep(SETTLE_S)
    assert _served_by(cluster, SYSTEM + _question(5))[0] == 1
    port = prefills[1].address.rsplit(":", 1)[1]
    assert prefills[1].stop() == 0  # its cache (and any event about it) is gone
    prefills[1] = start_services([("prefill", ("--model", tiny_llama, *ARGS, "--port", port))], env=ENV)[0]
    time.sleep(3 * SETTLE_S)  # the router resubscribes with back-off
    index, finished = _served_by(cluster, SYSTEM + _question(6))
    assert index == 0 and finished.usage.cached_prompt_tokens == 0, "stale entries of the restarted worker"
    _evict_everything(prefills[0])  # worker 0 now holds the prefix too: take it away again
    _prefill_directly(prefills[1], SYSTEM + [9, 9, 9])
    time.sleep(2 * SETTLE_S)  # past the router's resubscription back-off (at most 1 s)
    index, finished = _served_by(cluster, SYSTEM + _question(7))
    assert index == 1 and finished.usage.cached_prompt_tokens == len(SYSTEM), "the new subscription is not live"


def test_a_popular_prefix_still_spreads_under_load(cluster):
    """Every request wants the worker holding the prefix; once the uncached work queued there costs more
    than recomputing the prefix elsewhere, requests spill over: that queue cannot grow without bound."""
    burst = 32

    async def run() -> None:
        async with grpc.aio.insecure_channel(cluster["router"].address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def one(i: int) -> None:
                question = [(11 * i + k) % 300 + 200 for k in range(48)]  # 12 uncached blocks each: a queue builds
                request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=SYSTEM + question),
                                                         sampling=common_pb2.SamplingParams(temperature=0, max_tokens=2))
                async for _ in stub.Generate(request, timeout=60):
                    pass

            await asyncio.gather(*(one(i) for i in range(burst)))

    before = [_exported(p) for p in cluster["prefills"]]
    asyncio.run(run())
    served = [_exported(p) - b for p, b in zip(cluster["prefills"], before)]
    assert sum(served) == burst and min(served) >= 4, f"one worker took nearly everything: {served}"
    assert_no_leaks([*cluster["prefills"], cluster["decode"]])

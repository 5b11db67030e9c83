"""Conditional disaggregation over real processes: long prompts go to the prefill worker, short ones and
those arriving while the prefill queue is saturated prefill on the decode worker; all match HF greedy."""
from __future__ import annotations

import signal
import threading

import pytest

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.hf_reference import hf_greedy
from tests.integration.conftest import WORKER_ENV
from tests.integration.leaks import assert_no_leaks
from tests.integration.observed import scrape, wait_for
from tests.integration.processes import ServiceProcess, start_services, stop_cleanly

MAX_LOCAL = 16
MAX_TOKENS = 6
REMOTE = 'disagg_routing_prefill_decisions_total{reason="long_uncached",where="remote"}'
SHORT = 'disagg_routing_prefill_decisions_total{reason="short_uncached",where="local"}'
QUEUE_FULL = 'disagg_routing_prefill_decisions_total{reason="prefill_queue_full",where="local"}'
EXPORTED = "disagg_kv_sessions_exported_total"


@pytest.fixture(scope="module")
def cluster(tiny_llama, worker_pair):
    """The shared prefill and decode (conftest.worker_pair: tiny_llama, TINY_ENGINE_ARGS) under a router of this
    module's that treats any prefill in flight as a saturated queue. The tests read counters as differences."""
    router = start_services([("router", ("--model", tiny_llama, "--prefill-workers", worker_pair.prefill.address,
                                         "--decode-workers", worker_pair.decode.address,
                                         "--max-local-prefill-tokens", str(MAX_LOCAL),
                                         "--max-prefill-queue-tokens", "1"))], env=WORKER_ENV)[0]
    try:
        yield {"prefill": worker_pair.prefill, "decode": worker_pair.decode, "router": router}
    finally:
        stop_cleanly([router])  # the workers are stopped, and checked, with the rest of kv_workers


def _prompt(seed: int, length: int) -> list[int]:
    return [(37 * seed + 11 * k) % 500 + 3 for k in range(length)]


def _generate(router: ServiceProcess, prompt: list[int]) -> list[int]:
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt),
                                             sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                             stop=common_pb2.StopConditions(ignore_eos=True))
    with router.channel() as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
    return [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]


def _counts(cluster) -> dict[str, float]:
    router, prefill = scrape(cluster["router"]), scrape(cluster["prefill"])
    return {key: router.get(key, 0.0) for key in (REMOTE, SHORT, QUEUE_FULL)} | {EXPORTED: prefill.get(EXPORTED, 0.0)}


def _grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in before if after[key] != before[key]}


def test_a_long_prompt_prefills_on_the_prefill_worker(cluster, tiny_llama):
    prompt = _prompt(1, 3 * MAX_LOCAL)
    before = _counts(cluster)
    assert _generate(cluster["router"], prompt) == hf_greedy(tiny_llama, prompt, MAX_TOKENS)[0]
    assert _grew(before, _counts(cluster)) == {REMOTE: 1, EXPORTED: 1}


def test_a_short_prompt_prefills_on_the_decode_worker(cluster, tiny_llama):
    prompt = _prompt(2, MAX_LOCAL)
    before = _counts(cluster)
    assert _generate(cluster["router"], prompt) == hf_greedy(tiny_llama, prompt, MAX_TOKENS)[0]
    assert _grew(before, _counts(cluster)) == {SHORT: 1}


def test_a_saturated_prefill_queue_sends_a_long_prompt_to_the_decode_worker(cluster, tiny_llama):
    """The prefill worker is frozen (SIGSTOP) with one request's prefill in flight: the next long prompt
    runs entirely on the decode worker, and the frozen one completes once the worker resumes."""
    router, prefill = cluster["router"], cluster["prefill"]
    first, second = _prompt(3, 3 * MAX_LOCAL), _prompt(4, 3 * MAX_LOCAL)
    before = _counts(cluster)
    results: dict[str, object] = {}

    def run_first() -> None:
        try:
            results["tokens"] = _generate(router, first)
        except Exception as exc:  # reported by the assertion below
            results["error"] = exc

    prefill.signal(signal.SIGSTOP)
    thread = threading.Thread(target=run_first, name="first-request")
    try:
        thread.start()
        wait_for(lambda: scrape(router).get(REMOTE, 0.0) > before[REMOTE], 30, "the first request to go remote")
        assert _generate(router, second) == hf_greedy(tiny_llama, second, MAX_TOKENS)[0]
        assert "tokens" not in results, "the first request finished while its prefill worker was stopped"
    finally:
        prefill.signal(signal.SIGCONT)
        thread.join(60)
    assert results.get("tokens") == hf_greedy(tiny_llama, first, MAX_TOKENS)[0], results.get("error")
    assert _grew(before, _counts(cluster)) == {REMOTE: 1, QUEUE_FULL: 1, EXPORTED: 1}
    assert_no_leaks([prefill, cluster["decode"]])

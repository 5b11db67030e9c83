"""1P1D over a node-wide disk KV tier (the worker flags `disagg up --shared-kv-cache` sets: one --disk-kv-cache-dir,
one budget, --kv-cache-write-through): the decode worker writes its finished request's blocks, prompt and answer,
to the shared directory, and the next turn's prefill finds them, reporting turn 1's prompt and answer as cached
tokens, with the greedy tokens of the same pair without tiers (which caches turn 1's prompt alone)."""
from __future__ import annotations

import pytest

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.integration.observed import scrape, wait_for
from tests.integration.processes import ServiceProcess, prefill_decode

BLOCK = 4
ARGS = ("--block-size", str(BLOCK), "--num-kv-blocks", "64")
ENV = {"OMP_NUM_THREADS": "1"}
PROMPT = [(13 * k) % 400 + 50 for k in range(30)]  # 7 full blocks and 2 tokens
ANSWER_TOKENS = 12
FOLLOW_UP = [301, 302, 303, 304, 305, 306, 307]


@pytest.fixture(scope="module")
def shared(tiny_llama, tmp_path_factory):
    node = tmp_path_factory.mktemp("node-kv")
    with prefill_decode(tiny_llama, (*ARGS, "--disk-kv-cache-dir", str(node), "--disk-kv-cache-gb", "0.5",
                                     "--kv-cache-write-through"), ENV) as processes:
        yield processes


@pytest.fixture(scope="module")
def plain(tiny_llama):
    with prefill_decode(tiny_llama, ARGS, ENV) as processes:
        yield processes


def _generate(router: ServiceProcess, prompt: list[int]) -> tuple[list[int], common_pb2.Finished]:
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS),
        stop=common_pb2.StopConditions(ignore_eos=True))
    tokens, finished = [], None
    with router.channel() as channel:
        for response in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60):
            if response.HasField("delta"):
                tokens += response.delta.token_ids
            else:
                finished = response.finished
    return tokens, finished


def _metric(process: ServiceProcess, name: str, tier: str) -> float:
    return sum(v for k, v in scrape(process).items() if k.startswith(name + "{") and f'tier="{tier}"' in k)


def _two_turns(processes: list[ServiceProcess], written: int | None) -> tuple[list[int], list[int],
                                                                              common_pb2.Finished]:
    router, _, decode = processes
    answer, _ = _generate(router, PROMPT)
    if written is not None:  # the decode worker's write-through runs on its tiers' thread, after the answer is sent
        wait_for(lambda: _metric(decode, "disagg_kv_tier_offload_blocks_total", "disk") >= written, 20.0,
                 f"the decode worker to write {written} blocks through to the shared tier")
    following, finished = _generate(router, PROMPT + answer + FOLLOW_UP)
    return answer, following, finished


def test_the_next_turns_prefill_finds_the_decode_workers_answer_in_the_shared_tier(shared, plain):
    computed = len(PROMPT) + ANSWER_TOKENS - 1  # decode never computes the last token it samples
    answer, following, finished = _two_turns(shared, written=computed // BLOCK)
    plain_answer, plain_following, plain_finished = _two_turns(plain, written=None)
    assert (answer, following) == (plain_answer, plain_following)
    assert len(answer) == ANSWER_TOKENS
    assert finished.usage.cached_prompt_tokens == computed // BLOCK * BLOCK  # turn 1's prompt and answer
    assert plain_finished.usage.cached_prompt_tokens == len(PROMPT) // BLOCK * BLOCK  # its prompt alone
    prefill = shared[1]
    from_tier = computed // BLOCK * BLOCK - len(PROMPT) // BLOCK * BLOCK  # past what its own device pool holds
    assert _metric(prefill, "disagg_kv_tier_hit_tokens_total", "disk") == from_tier

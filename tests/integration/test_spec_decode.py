"""Speculative decoding across processes: prefill → decode with n-gram drafts on both workers (--speculative-config,
as `disagg up` passes every engine flag), greedy tokens the same as the same pair without it, the decode worker's
Prometheus counting the drafts it verified and accepted, and every KV block back on both workers after the
requests (a cancel mid-stream too)."""
from __future__ import annotations

import pytest

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.integration.observed import scrape, wait_for
from tests.integration.processes import ServiceProcess, prefill_decode

ARGS = ("--block-size", "4", "--num-kv-blocks", "128")
ENV = {"OMP_NUM_THREADS": "1"}
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
PROMPTS = [[5, 6, 7, 8, 9] * 5, [40, 41, 42] * 8 + [43], [(13 * k) % 400 + 50 for k in range(30)]]
ANSWER_TOKENS = 20


@pytest.fixture(scope="module")
def speculating(tiny_llama):
    with prefill_decode(tiny_llama, (*ARGS, "--speculative-config", NGRAM), ENV) as processes:
        yield processes


@pytest.fixture(scope="module")
def plain(tiny_llama):
    with prefill_decode(tiny_llama, ARGS, ENV) as processes:
        yield processes


def _generate(router: ServiceProcess, prompt: list[int], max_tokens: int = ANSWER_TOKENS) -> list[int]:
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
        stop=common_pb2.StopConditions(ignore_eos=True))
    tokens = []
    with router.channel() as channel:
        for response in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60):
            if response.HasField("delta"):
                tokens += response.delta.token_ids
    return tokens


def _total(process: ServiceProcess, name: str) -> float:
    return sum(v for k, v in scrape(process).items() if k.partition("{")[0] == name)


def _blocks_free(process: ServiceProcess) -> bool:
    usage = [v for k, v in scrape(process).items() if k.partition("{")[0] == "disagg_kv_cache_usage_ratio"]
    return usage == [0.0]


def test_prefill_to_decode_with_ngram_drafts_gives_the_same_greedy_tokens(speculating, plain):
    router, _, decode = speculating
    got = [_generate(router, p) for p in PROMPTS]
    assert got == [_generate(plain[0], p) for p in PROMPTS]
    assert all(len(tokens) == ANSWER_TOKENS for tokens in got)
    assert _total(decode, "disagg_spec_decode_draft_tokens_total") > 0
    assert _total(decode, "disagg_spec_decode_accepted_tokens_total") > 0


def test_a_cancel_mid_speculation_gives_every_block_back(speculating):
    router = speculating[0]
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=PROMPTS[0]),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=400),
        stop=common_pb2.StopConditions(ignore_eos=True))
    with router.channel() as channel:
        stream = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
        seen = 0
        for response in stream:
            seen += len(response.delta.token_ids) if response.HasField("delta") else 0
            if seen >= 12:
                stream.cancel()
                break
    for worker in speculating[1:]:
        wait_for(lambda w=worker: _blocks_free(w), 20.0, f"{worker.name} to free every KV block")


def test_the_decode_workers_ready_line_says_it_speculates_and_the_prefill_workers_does_not(speculating):
    """`disagg up`'s summary repeats each worker's ready line: a user sees where drafts run without reading logs."""
    _, prefill, decode = speculating
    line = next(line for line in decode.log().splitlines() if "serving on" in line)
    assert "speculative decoding ngram, up to 3 drafts a step" in line
    assert "speculative" not in next(line for line in prefill.log().splitlines() if "serving on" in line)

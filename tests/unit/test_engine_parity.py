"""Greedy output of our engine equals Hugging Face transformers, token for token, in every scheduling situation."""
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from tests.hf_reference import hf_greedy
from tests.tiny_models import TINY_FAMILIES

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _engine(path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, **{"block_size": 4, "num_kv_blocks": 256, **overrides}))


def _run_all(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_greedy_matches_hf_for_each_family(tiny_model_dirs, family):
    path = tiny_model_dirs[family]
    engine = _engine(path)
    prompts = _prompts([5, 11, 17])
    outputs = engine.generate(prompts, GREEDY)
    for prompt, got in zip(prompts, outputs):
        assert got == hf_greedy(path, prompt, 12)[0]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_logprobs_match_hf_within_1e4(tiny_llama):
    engine = _engine(tiny_llama)
    prompt = _prompts([9])[0]
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True,
                                                   top_logprobs=3))
    logprobs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs.extend(out.new_logprobs)
    ref_tokens, ref_logprobs = hf_greedy(tiny_llama, prompt, 8)
    assert [lp.token_id for lp in logprobs] == ref_tokens
    assert max(abs(lp.logprob - ref) for lp, ref in zip(logprobs, ref_logprobs)) < 1e-4
    for lp in logprobs:  # greedy: the chosen token is the top-1 alternative
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id


def test_requests_joining_mid_decode_match_hf(tiny_llama):
    engine = _engine(tiny_llama)
    first, *late = _prompts([7, 3, 13, 21], seed=1)
    engine.add_request("first", first, GREEDY)
    tokens: dict[str, list[int]] = {}
    for _ in range(4):  # "first" is decoding when the others arrive
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, prompt in enumerate(late):
        engine.add_request(f"late{i}", prompt, GREEDY)
    for rid, toks in _run_all(engine).items():
        tokens.setdefault(rid, []).extend(toks)
    assert tokens["first"] == hf_greedy(tiny_llama, first, 12)[0]
    for i, prompt in enumerate(late):
        assert tokens[f"late{i}"] == hf_greedy(tiny_llama, prompt, 12)[0]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_cache_hit_matches_hf_and_skips_work(tiny_llama):
    engine = _engine(tiny_llama)
    shared = _prompts([24], seed=2)[0]
    a, b = shared + [5, 6, 7], shared + [8, 9]
    assert engine.generate([a], GREEDY)[0] == hf_greedy(tiny_llama, a, 12)[0]
    request = engine.add_request("b", b, GREEDY)
    tokens = _run_all(engine)["b"]
    assert request.num_cached_tokens == 24  # six full blocks of the shared prefix
    assert tokens == hf_greedy(tiny_llama, b, 12)[0]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_identical_prompt_twice_reuses_all_but_the_last_token(tiny_llama):
    engine = _engine(tiny_llama)
    prompt = _prompts([16], seed=3)[0]
    first = engine.generate([prompt], GREEDY)[0]
    request = engine.add_request("again", prompt, GREEDY)
    assert _run_all(engine)["again"] == first
    assert request.num_cached_tokens == 12  # block-aligned prompt: the last block is recomputed for logits


def test_preemption_by_recompute_matches_hf(tiny_llama):
    # 10 blocks of 4 tokens cannot hold three requests growing to 24+ tokens: admitted while blocks last (no growth
    # reserve), someone is preempted.
    engine = _engine(tiny_llama, num_kv_blocks=10, enable_prefix_caching=False, kv_growth_reserve=0)
    prompts = _prompts([10, 12, 14], seed=4)
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    assert engine.num_preemptions > 0 and engine.load_snapshot().preemptions == engine.num_preemptions  # (GetLoad's)
    for prompt, got in zip(prompts, outputs):
        assert got == hf_greedy(tiny_llama, prompt, 14)[0]
    assert engine.block_manager.num_free_blocks == 10


def test_the_growth_reserve_queues_a_newcomer_instead_of_preempting(tiny_llama):
    """The same pool and requests with the default growth reserve: the third request waits until the first two
    have room to finish, nobody is preempted, and every output is still HF's."""
    engine = _engine(tiny_llama, num_kv_blocks=10, enable_prefix_caching=False)
    prompts = _prompts([10, 12, 14], seed=4)
    ids = [f"r{i}" for i in range(3)]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    outputs, waited = {rid: [] for rid in ids}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        waited += bool(engine.scheduler.waiting) and bool(engine.scheduler.running)
    assert engine.num_preemptions == 0 and waited > 0
    for rid, prompt in zip(ids, prompts):
        assert outputs[rid] == hf_greedy(tiny_llama, prompt, 14)[0]
    assert engine.block_manager.num_free_blocks == 10


def test_an_idle_engine_keeps_no_growth_reserve(tiny_llama):
    """The reserve the last step published goes with the last running request (an abort here, mid-generation):
    idle, the engine steps no more, and an import (the KV data plane's reserve) takes the whole pool at once."""
    engine = _engine(tiny_llama, num_kv_blocks=64, enable_prefix_caching=False)
    engine.add_request("r", _prompts([10], seed=5)[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.growth_reserved > 0 and engine.block_manager.reserve(64) is None
    assert engine.abort_request("r")
    assert engine.block_manager.growth_reserved == 0 and len(engine.block_manager.reserve(64)) == 64


def test_chunked_prefill_splits_a_long_prompt_and_matches_hf(tiny_llama):
    engine = _engine(tiny_llama, max_num_batched_tokens=8)
    long_prompt, short_prompt = _prompts([45, 5], seed=5)
    engine.add_request("long", long_prompt, GREEDY)
    steps_before_first_token = 0
    tokens: dict[str, list[int]] = {}
    engine.add_request("short", short_prompt, GREEDY)
    while engine.has_unfinished_requests():
        outs = engine.step()
        if "long" not in tokens:
            steps_before_first_token += 1
        for out in outs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert steps_before_first_token >= 6  # 45 tokens at most 8 per step
    assert tokens["long"] == hf_greedy(tiny_llama, long_prompt, 12)[0]
    assert tokens["short"] == hf_greedy(tiny_llama, short_prompt, 12)[0]


def test_stops_at_eos_like_hf(tiny_llama):
    engine = _engine(tiny_llama)
    prompt = _prompts([6], seed=6)[0]
    ref, _ = hf_greedy(tiny_llama, prompt, 40, stop_at_eos=True)
    got = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    assert got == ref

"""Speculative decoding in the engine (common/engine/spec/speculator.py), on the CPU with a tiny random model: the same
tokens with and without it (greedy, and seeded sampling), drafts accepted where the text repeats, every block
back after an abort mid-speculation, the step budget and max_tokens kept, logprobs for every accepted token, and a
sampled row's tokens following the target's distribution (chi-square against the same engine without drafts)."""
from __future__ import annotations

import collections

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from common.engine.spec.config import parse_speculative_config
from common.errors import InvalidConfig

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
REPEATING = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 9 + [43], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _engine(model: str, spec: str | None, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, speculative_config=parse_speculative_config(spec),
                                  **{"block_size": 4, "num_kv_blocks": 256, **overrides}))


def _always_speculate(engine: LLMEngine) -> None:
    """Every row drafts K whatever its acceptance (the default policy would stop a row whose drafts fail)."""
    engine.speculator.set_policies({1: type(engine.speculator.policy_for(1)).linear(4, 0.0)})


def _accepted(engine: LLMEngine) -> float:
    return engine.speculator.metrics.total("disagg_spec_decode_accepted_tokens_total", method="ngram")


@pytest.fixture(scope="module")
def plain_greedy(tiny_llama) -> list[list[int]]:
    return _engine(tiny_llama, None).generate(REPEATING, GREEDY)


def test_greedy_tokens_are_the_same_with_ngram_drafts_and_drafts_are_accepted(tiny_llama, plain_greedy):
    engine = _engine(tiny_llama, NGRAM)
    _always_speculate(engine)
    assert engine.generate(REPEATING, GREEDY) == plain_greedy
    assert _accepted(engine) > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.speculator._rows  # every request's state forgotten


def test_seeded_sampling_draws_the_same_tokens_with_drafts(tiny_llama):
    sampling = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    expected = _engine(tiny_llama, None).generate(REPEATING, sampling)
    engine = _engine(tiny_llama, NGRAM)
    _always_speculate(engine)
    assert engine.generate(REPEATING, sampling) == expected


def test_several_choices_and_max_tokens_are_kept(tiny_llama):
    sampling = SamplingParams(temperature=0, n=2, max_tokens=9, ignore_eos=True)
    engine = _engine(tiny_llama, NGRAM)
    _always_speculate(engine)
    engine.add_request("n2", REPEATING[0], sampling)
    tokens = collections.defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.index] += out.new_token_ids
            assert len(tokens[out.index]) <= 9
    assert {i: len(t) for i, t in tokens.items()} == {0: 9, 1: 9}
    plain = _engine(tiny_llama, None)
    assert tokens[0] == plain.generate([REPEATING[0]], SamplingParams(temperature=0, max_tokens=9,
                                                                     ignore_eos=True))[0]


def test_every_accepted_token_has_its_logprob(tiny_llama):
    sampling = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2)
    engine = _engine(tiny_llama, NGRAM)
    _always_speculate(engine)
    engine.add_request("lp", REPEATING[0], sampling)
    reference = _engine(tiny_llama, None)
    reference.add_request("lp", REPEATING[0], sampling)
    got, want = [], []
    for e, into in ((engine, got), (reference, want)):
        while e.has_unfinished_requests():
            for out in e.step():
                assert len(out.new_logprobs) == len(out.new_token_ids)
                into += out.new_logprobs
    assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
    assert all(abs(a.logprob - b.logprob) < 1e-4 and len(a.top) == 2 for a, b in zip(got, want))
    assert _accepted(engine) > 0


def test_an_abort_mid_speculation_frees_every_block(tiny_llama):
    engine = _engine(tiny_llama, NGRAM)
    _always_speculate(engine)
    engine.add_request("a", REPEATING[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.scheduler.running[0].draft_token_ids or _accepted(engine) > 0
    engine.abort_request("a")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests() and not engine.speculator._rows


def test_drafts_stay_within_the_step_budget(tiny_llama):
    engine = _engine(tiny_llama, NGRAM, max_num_batched_tokens=6)
    _always_speculate(engine)
    for i, prompt in enumerate(REPEATING[:2]):
        engine.add_request(str(i), prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        assert engine.last_step is None or engine.last_step.tokens <= 6


def test_a_model_method_without_its_model_directory_is_refused_at_start_naming_it(tiny_llama):
    with pytest.raises(InvalidConfig, match="no EAGLE-3 head config in /x"):
        _engine(tiny_llama, '{"method": "eagle3", "model": "/x", "num_speculative_tokens": 2}')


def test_sampled_tokens_after_a_draft_follow_the_targets_distribution(tiny_llama):
    """The two tokens a verify step draws (the one at the row's last token, then, where it equals the draft, the
    one after the draft) against the same engine drawing them one a step without drafts: a two-sample chi-square
    over the pairs. Every row drafts a repeat of its last token, right only as often as the target picks it."""
    sampling = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    prompt = [11, 12, 13, 11, 12, 13, 11, 12]
    rows = 256

    def second_tokens(spec: str | None) -> collections.Counter:
        engine = _engine(tiny_llama, spec, max_num_seqs=rows, num_kv_blocks=4 * rows, max_num_batched_tokens=4096)
        if spec:
            _always_speculate(engine)
            engine.speculator.forced_k = 1
        counts: collections.Counter = collections.Counter()
        for _ in range(2):
            for out in engine.generate([prompt] * rows, sampling):
                counts[tuple(out[1:])] += 1  # (the first is the prompt's; the verify step draws these)
        return counts

    a, b = second_tokens(None), second_tokens(NGRAM)
    keys = sorted(set(a) | set(b))
    kept = [k for k in keys if a[k] + b[k] >= 10]  # (cells too small for the statistic are left out)
    na, nb = sum(a[k] for k in kept), sum(b[k] for k in kept)
    statistic = sum((a[k] * (nb / na) ** 0.5 - b[k] * (na / nb) ** 0.5) ** 2 / (a[k] + b[k]) for k in kept)
    df = len(kept) - 1
    # The chi-square quantile at alpha 0.001 (Wilson-Hilferty): a correct sampler fails one run in a thousand.
    z = 3.0902
    limit = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    assert df >= 3 and statistic < limit, (statistic, limit, a, b)


def test_with_async_scheduling_steps_without_drafts_go_ahead_and_tokens_stay_the_same(tiny_llama, plain_greedy):
    """Where no row would draft (its K is 0), the next step is launched ahead as without speculation; where one
    would, the engine reads the step's tokens first. Both ways the greedy tokens are the ones without drafts."""
    for cost in (0.0, 50.0):  # drafts free: every step speculates; drafts dear: none does, every step goes ahead
        engine = _engine(tiny_llama, NGRAM, async_scheduling=True)
        engine.speculator.set_policies({1: type(engine.speculator.policy_for(1)).linear(4, cost)})
        for i, prompt in enumerate(REPEATING):
            engine.add_request(str(i), prompt, GREEDY)
        tokens, ahead = {str(i): [] for i in range(len(REPEATING))}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            ahead += engine.last_step is not None and engine.last_step.launched_ahead
        assert list(tokens.values()) == plain_greedy
        assert (_accepted(engine) > 0) == (cost == 0.0)
        assert (ahead > 0) == (cost > 0.0)

"""Sampling parameters: validation, reproducibility, and what each filter keeps."""
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import Request, SamplingParams
from common.engine.sampler import Sampler, _filter
from common.errors import InvalidRequest


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"min_p": 2.0}, r"min_p must be in \[0, 1\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"top_logprobs": 21}, r"top_logprobs must be in \[0, 20\]"),
    ({"stop": ("",)}, "stop strings must not be empty"),
])
def test_bad_sampling_values_are_rejected_with_the_limit(kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**kwargs)


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    kept = torch.isfinite(_filter(logits, top_k=2, top_p=1.0, min_p=0.0))
    assert kept.tolist() == [False, True, False, True, False]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = torch.isfinite(_filter(probs.log(), top_k=0, top_p=0.7, min_p=0.0))
    assert kept.tolist() == [True, True, False, False]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    probs = torch.tensor([0.6, 0.3, 0.07, 0.03])
    kept = torch.isfinite(_filter(probs.log(), top_k=0, top_p=1.0, min_p=0.1))
    assert kept.tolist() == [True, True, True, False]


def test_repetition_penalty_follows_hf():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0]])
    request = Request("r", [0, 1], SamplingParams(temperature=0, repetition_penalty=1.7))
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[0, 1]]), logits.clone())
    from common.engine.penalties import adjusted_logits
    assert torch.allclose(adjusted_logits(logits, [request]), expected)


def test_seeded_requests_are_reproducible_and_seed_dependent(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=128))
    prompt = list(range(5, 20))

    def run(seed):
        return engine.generate([prompt], SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True))[0]

    assert run(7) == run(7)
    assert run(7) != run(8)
    # The same seed in a batch with other traffic draws the same tokens.
    batch = engine.generate([prompt, prompt[:7], prompt[3:]],
                            SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True))
    assert batch[0] == run(7)


def test_sampled_tokens_respect_top_k_1_as_greedy(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=128))
    prompt = list(range(5, 20))
    greedy = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    top1 = engine.generate([prompt], SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True))[0]
    assert top1 == greedy


def test_sampler_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    request = Request("r", [0], SamplingParams(temperature=0, logprobs=True, top_logprobs=2))
    ((token, lp),) = Sampler()(logits, [request])
    expected = torch.log_softmax(logits[0], -1)
    assert token == 2 and lp.logprob == pytest.approx(float(expected[2]))
    assert [t for t, _ in lp.top] == [2, 1]


def test_each_row_of_a_batch_is_filtered_with_its_own_values():
    """The batched filter gives each row what that row's values give it alone."""
    from common.engine.sampler import _kept_probs
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    values = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.6, 0.0), (8, 0.7, 0.2)]
    rows = _kept_probs(logits, *map(list, zip(*values)))
    for row, alone, (k, p, m) in zip(rows, logits, values):
        assert torch.equal(row > 0, torch.isfinite(_filter(alone, top_k=k, top_p=p, min_p=m)))
    assert (rows[0] > 0).all() and (rows[1] > 0).sum() == 5


def test_a_nucleus_beyond_the_cpu_head_is_found_by_ranking_the_whole_row():
    """A flat row (random weights, a high temperature) whose top-p mass lies beyond the most likely 256 tokens keeps
    what sorting the whole row keeps, beside a peaked row found in its head."""
    from common.engine import sampler
    flat = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 0.1
    peaked = torch.cat([torch.tensor([12.0, 11.0, 10.5]), torch.zeros(4093)])
    probs = sampler._kept_probs(torch.stack([flat, peaked]), [0, 0], [0.9, 0.9], [0.0, 0.0])
    ranked = flat.softmax(-1).sort(descending=True).values
    expected = int(((ranked.cumsum(-1) - ranked) < 0.9).sum())
    assert expected > sampler._NUCLEUS_HEAD
    assert int((probs[0] > 0).sum()) == expected and int((probs[1] > 0).sum()) == 3


def test_seeded_draws_follow_the_distribution():
    """A sampled row draws token i with probability p_i: 4000 seeds (one draw each, deterministic) land
    within 0.03 of each probability, and a filtered token is never drawn."""
    probs = torch.tensor([0.45, 0.3, 0.15, 0.07, 0.03])
    counts = torch.zeros(5)
    sampler = Sampler()
    requests = [Request(f"r{i}", [0], SamplingParams(temperature=1.0, seed=i)) for i in range(4000)]
    counts += torch.bincount(sampler.draw(probs.log().expand(4000, 5).clone(), requests), minlength=5)
    assert torch.allclose(counts / 4000, probs, atol=0.03), counts / 4000
    top2 = [Request(f"k{i}", [0], SamplingParams(temperature=1.0, top_k=2, seed=i)) for i in range(500)]
    assert set(sampler.draw(probs.log().expand(500, 5).clone(), top2).tolist()) == {0, 1}


def test_a_seeded_draw_depends_on_the_output_position_and_choice_only():
    """The same seed, position and choice draw the same token whatever else is in the batch; another position or
    choice draws afresh (a step launched ahead passes the position it samples)."""
    logits = torch.zeros(3, 64)
    sampler = Sampler()
    seeded = Request("s", [0], SamplingParams(temperature=1.0, seed=9))
    others = [Request(f"o{i}", [0], SamplingParams(temperature=0.5)) for i in range(2)]
    alone = sampler.draw(logits[:1], [seeded], [4]).item()
    assert sampler.draw(logits, [others[0], seeded, others[1]], [0, 4, 0])[1].item() == alone
    draws = [sampler.draw(logits[:1], [seeded], [step]).item() for step in range(12)]
    assert len(set(draws)) > 1
    choice_1 = Request("s#1", [0], SamplingParams(temperature=1.0, seed=9), index=1)
    assert [sampler.draw(logits[:1], [choice_1], [step]).item() for step in range(12)] != draws

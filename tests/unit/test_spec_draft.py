"""Draft-model speculative decoding (common/engine/spec/draft.py) on the CPU with tiny random models: greedy tokens
the same as without speculation and as Hugging Face's with a one-layer draft, seeded sampling reproducible, a draft
that is the target itself accepted nearly always (its drafts are real), a draft of another vocabulary refused at
start naming both, the draft engine holding no request or block once its target's requests end or are aborted,
and the drafts counted under method "draft"."""
from __future__ import annotations

import json

import pytest
import tokenizers
import torch
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from common.engine.spec.config import parse_speculative_config
from common.engine.spec.draft import check_same_vocabulary
from common.errors import InvalidConfig
from tests.hf_reference import hf_greedy
from tests.tiny_models import _COMMON

PROMPTS = [[5, 6, 7, 8, 9] * 4, [40, 41, 42, 43, 44, 45, 46], list(range(100, 131))]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _draft_dir(root, layers: int = 1, **changes) -> str:
    torch.manual_seed(1)
    config = LlamaConfig(**{**_COMMON, "num_hidden_layers": layers, "num_key_value_heads": 2,
                            "tie_word_embeddings": False, **changes})
    LlamaForCausalLM(config).eval().save_pretrained(root, safe_serialization=True)
    return str(root)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory) -> str:
    return _draft_dir(tmp_path_factory.mktemp("draft-1-layer"))


def _spec(model: str, k: int = 3) -> str:
    return json.dumps({"method": "draft", "model": model, "num_speculative_tokens": k})


def _engine(model: str, spec: str | None, **overrides) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=model, speculative_config=parse_speculative_config(spec),
                                    **{"block_size": 4, "num_kv_blocks": 128, **overrides}))
    if spec is not None:  # every row drafts K whatever its acceptance (the default policy stops failing drafts)
        engine.speculator.set_policies({1: type(engine.speculator.policy_for(1)).linear(3, 0.0)})
    return engine


def _count(engine: LLMEngine, name: str) -> float:
    return engine.speculator.metrics.total(f"disagg_spec_decode_{name}_total", method="draft")


def _draft_engine(engine: LLMEngine) -> LLMEngine:
    return engine.speculator.proposer.engine


def test_greedy_tokens_with_a_small_draft_are_those_without_it_and_hfs(tiny_llama, small_draft):
    engine = _engine(tiny_llama, _spec(small_draft))
    got = engine.generate(PROMPTS, GREEDY)
    assert got == _engine(tiny_llama, None).generate(PROMPTS, GREEDY)
    assert got == [hf_greedy(tiny_llama, p, GREEDY.max_tokens)[0] for p in PROMPTS]
    assert _count(engine, "draft_tokens") > 0 and _count(engine, "drafts") > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_draws_the_same_tokens_with_a_draft_model(tiny_llama, small_draft):
    sampling = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)
    expected = _engine(tiny_llama, None).generate(PROMPTS, sampling)
    assert _engine(tiny_llama, _spec(small_draft)).generate(PROMPTS, sampling) == expected
    assert _engine(tiny_llama, _spec(small_draft)).generate(PROMPTS, sampling) == expected


def test_a_draft_that_is_the_target_has_nearly_every_draft_accepted(tiny_llama):
    engine = _engine(tiny_llama, _spec(tiny_llama, k=4))
    got = engine.generate(PROMPTS, GREEDY)
    assert got == _engine(tiny_llama, None).generate(PROMPTS, GREEDY)
    proposed, accepted = _count(engine, "draft_tokens"), _count(engine, "accepted_tokens")
    assert proposed >= 10 and accepted >= 0.9 * proposed, (accepted, proposed)
    # A verify emits its drafts and the bonus: 5 tokens, fewer only where max_tokens leaves less room for drafts.
    assert engine.speculator.metrics.mean_accepted_length("draft") > 3.5


def test_the_step_drafts_every_row_in_one_batched_draft_loop(tiny_llama, small_draft):
    engine = _engine(tiny_llama, _spec(small_draft))
    calls = []
    proposer = engine.speculator.proposer
    batched = proposer.propose_many
    proposer.propose_many = lambda histories, ks, ids: calls.append(len(histories)) or batched(histories, ks, ids)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert calls and max(calls) == len(PROMPTS)


def test_a_draft_of_another_vocabulary_is_refused_at_start_naming_both(tiny_llama, tmp_path):
    other = _draft_dir(tmp_path / "other-vocab", vocab_size=256)
    with pytest.raises(InvalidConfig, match="vocabulary of 256 tokens") as raised:
        _engine(tiny_llama, _spec(other))
    assert other in str(raised.value) and tiny_llama in str(raised.value)


def test_tokenizers_that_differ_are_refused_even_at_the_same_size(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root, vocab in ((a, {"x": 0, "y": 1}), (b, {"x": 1, "y": 0})):
        root.mkdir()
        (root / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 2}))
        PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(WordLevel(vocab))).save_pretrained(root)
    check_same_vocabulary(str(a), str(a))
    with pytest.raises(InvalidConfig, match="another tokenizer"):
        check_same_vocabulary(str(a), str(b))


def test_an_abort_mid_speculation_leaves_no_draft_request_or_held_block(tiny_llama, small_draft):
    engine = _engine(tiny_llama, _spec(small_draft))
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert _count(engine, "drafts") > 0
    engine.abort_request("a")
    engine.abort_request("b")
    draft = _draft_engine(engine)
    assert not draft.requests and not draft.has_unfinished_requests()
    assert draft.block_manager.num_free_blocks == draft.block_manager.num_blocks
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.speculator._rows


def test_a_draft_step_prefills_only_what_its_prefix_cache_lacks(tiny_llama, small_draft):
    engine = _engine(tiny_llama, _spec(small_draft))
    engine.add_request("a", PROMPTS[2], GREEDY)
    draft = _draft_engine(engine)
    engine.step()  # the target's prompt
    engine.step()  # the draft's first proposal: the whole prompt
    first = draft.block_manager.num_free_blocks
    step_tokens = []
    original = draft.step

    def counted():
        out = original()
        if draft.last_step is not None:
            step_tokens.append(draft.last_step.tokens)
        return out

    draft.step = counted
    engine.step()
    # One proposal after the first: the tokens past the last cached full block (< a block plus the new ones), then
    # one token a draft step.
    assert step_tokens and step_tokens[0] < 4 + 4 + 1 < len(PROMPTS[2]), step_tokens
    assert first == draft.block_manager.num_free_blocks == draft.block_manager.num_blocks


def test_the_step_costs_measured_at_start_run_the_draft_model_and_leave_both_engines_empty(tiny_llama, small_draft):
    from common.engine.spec.costs import measure_policies

    engine = _engine(tiny_llama, _spec(small_draft), max_num_seqs=2)
    drafted = []
    proposer = engine.speculator.proposer
    batched = proposer.propose_many
    proposer.propose_many = lambda histories, ks, ids: drafted.append(ks) or batched(histories, ks, ids)
    policies = measure_policies(engine)
    assert policies and all(p.max_k == 3 for p in policies.values())
    assert [3, 3] in drafted  # every row drafted K by the draft model, its time inside the step timed
    draft = _draft_engine(engine)
    assert not draft.requests and draft.block_manager.num_free_blocks == draft.block_manager.num_blocks
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_row_past_the_drafts_context_runs_plain_and_its_tokens_stay_the_same(tiny_llama, tmp_path):
    short = _draft_dir(tmp_path / "short-context", max_position_embeddings=40)
    engine = _engine(tiny_llama, _spec(short))
    assert engine.generate(PROMPTS[2:], GREEDY) == _engine(tiny_llama, None).generate(PROMPTS[2:], GREEDY)
    assert _count(engine, "drafts") > 0  # while its 31 + n tokens fit the draft's 40
    assert engine.speculator.metrics.total("disagg_spec_decode_plain_steps_total", method="draft",
                                           reason="no_draft") > 0

"""Requests and configs the engine refuses, each with a message that names the limit."""
import shutil

import pytest

from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import LLMEngine
from common.engine.request import FinishReason, SamplingParams
from common.tokenizer import Tokenizer
from common.errors import InvalidConfig, InvalidRequest, ResourceExhausted


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 3}, "block_size must be a power of two"),
    ({"num_kv_blocks": 0}, "num_kv_blocks must be >= 1"),
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1"),
    ({"max_model_len": 1}, "max_model_len must be >= 2"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"kv_growth_reserve": -1}, "--kv-growth-reserve must be >= 0 tokens, got -1"),
])
def test_bad_config_names_the_setting(kwargs, message):
    with pytest.raises(InvalidConfig, match=message):
        EngineConfig(model="x", **kwargs)


def test_max_model_len_above_the_model_is_refused(tiny_llama):
    with pytest.raises(InvalidConfig, match="exceeds the model's max_position_embeddings=512"):
        LLMEngine(EngineConfig(model=tiny_llama, max_model_len=4096))


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    return LLMEngine(EngineConfig(model=tiny_model_dirs["llama-gqa"], block_size=4, num_kv_blocks=64,
                                  max_model_len=64, max_waiting=2))


def test_bad_requests_are_refused_and_leave_nothing_behind(engine):
    cases = [
        ([], "prompt is empty"),
        (list(range(3, 67)), "prompt has 64 tokens; the model's context is 64"),
        ([3, 512, 9], r"token ids outside the vocabulary \[0, 512\): \[512\]"),
        ([-1], "outside the vocabulary"),
    ]
    for prompt, message in cases:
        with pytest.raises(InvalidRequest, match=message):
            engine.add_request("bad", prompt)
    assert not engine.has_unfinished_requests() and engine.requests == {}


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("dup", [3, 4, 5], SamplingParams(temperature=0, max_tokens=2))
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("dup", [3, 4, 5])
    engine.abort_request("dup")


def test_full_queue_is_resource_exhausted(engine):
    engine.add_request("q1", [3, 4])
    engine.add_request("q2", [3, 4])
    with pytest.raises(ResourceExhausted, match=r"queue is full: 2 requests waiting, its limit \(--max-waiting\)"):
        engine.add_request("q3", [3, 4])
    engine.abort_request("q1"), engine.abort_request("q2")


def test_generation_stops_at_the_context_limit(engine):
    out = engine.generate([list(range(3, 60))], SamplingParams(temperature=0, ignore_eos=True))[0]
    assert len(out) == 64 - 57


def test_abort_frees_every_block_wherever_the_request_is(engine):
    free = engine.block_manager.num_free_blocks
    engine.add_request("waiting", list(range(3, 30)))
    engine.add_request("running", list(range(3, 20)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < free
    assert engine.abort_request("running") and engine.abort_request("waiting")
    assert not engine.abort_request("running")
    assert engine.block_manager.num_free_blocks == free
    assert not engine.has_unfinished_requests()


def test_max_tokens_finishes_with_length(engine):
    engine.add_request("m", [3, 4, 5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert len(outs) == 3 and outs[-1].finish_reason is FinishReason.LENGTH


def test_stop_token_ids_finish_with_stop(engine):
    first = engine.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    engine.add_request("s", [3, 4, 5], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=(first[1],),
                                                       ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert [o.new_token_ids[0] for o in outs] == first[:2] and outs[-1].finish_reason is FinishReason.STOP


def test_the_engine_ignores_stop_strings(tiny_llama, tmp_path):
    """Stop strings are text, the router's to match; with a tokenizer at hand the engine still runs on."""
    model = shutil.copytree(tiny_llama, tmp_path / "with-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, model / name)
    engine = LLMEngine(EngineConfig(model=str(model), block_size=4, num_kv_blocks=64, max_model_len=64))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    full = engine.generate([[3, 4, 5]], greedy)[0]
    text = Tokenizer.from_model_dir(model).decode(full)
    stops = (text[:2], text[len(text) // 2:][:3])  # at the start and across the middle of the output
    assert all(stops)
    engine.add_request("s", [3, 4, 5], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stops))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert [t for o in outs for t in o.new_token_ids] == full and outs[-1].finish_reason is FinishReason.LENGTH
    assert engine.block_manager.num_free_blocks == 64

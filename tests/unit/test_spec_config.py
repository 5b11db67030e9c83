"""--speculative-config: vLLM's keys and defaults, clear errors, and which methods the engine can run."""
from __future__ import annotations

import pytest

from common.engine.spec.config import (DEFAULT_PROMPT_LOOKUP, MAX_SPECULATIVE_TOKENS, SpeculativeConfig,
                                       parse_speculative_config, require_supported)
from common.engine.spec.ngram import NgramProposer
from common.engine.spec.proposer import make_proposer
from common.errors import InvalidConfig


def test_ngram_json_parses_with_its_bounds():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, '
                                      '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                                       prompt_lookup_max=5)
    assert config.supported


@pytest.mark.parametrize("value", [None, "", "  ", "null"])
def test_unset_flag_is_no_speculation(value):
    assert parse_speculative_config(value) is None


def test_ngram_bounds_default_as_vllms():
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP)
    only_max = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


def test_method_inferred_from_model_as_vllm_does():
    assert parse_speculative_config({"model": "ngram", "num_speculative_tokens": 2}).method == "ngram"
    assert parse_speculative_config({"model": "/m/EAGLE3-Llama", "num_speculative_tokens": 2}).method == "eagle3"
    assert parse_speculative_config({"model": "/m/tiny", "num_speculative_tokens": 2}).method == "draft"
    assert parse_speculative_config({"method": "draft_model", "model": "/m/tiny",
                                     "num_speculative_tokens": 2}).method == "draft"


@pytest.mark.parametrize("value, words", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "unknown method 'medusa'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup": 3}, "unknown key(s) prompt_lookup"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "must be in [1, 16], got 0"),
    ({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "must be in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": True}, "must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m/tiny"}, "takes no model"),
    ({"method": "draft", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "draft", "model": "/m", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "ngram' only"),
    ({"num_speculative_tokens": 2}, "give \"method\""),
])
def test_bad_config_says_what_is_wrong(value, words):
    with pytest.raises(InvalidConfig, match="--speculative-config") as raised:
        parse_speculative_config(value)
    assert words in str(raised.value)


def test_eagle3_parses_with_its_head_directory_and_is_supported():
    config = parse_speculative_config({"method": "eagle3", "model": "/m/head", "num_speculative_tokens": 3,
                                       "draft_tensor_parallel_size": 1})
    assert config.model == "/m/head" and config.supported and config.reads_target_hidden
    require_supported(config)
    assert not parse_speculative_config({"method": "draft", "model": "/m/d", "num_speculative_tokens": 3}
                                        ).reads_target_hidden


def test_make_proposer_builds_ngram_from_its_bounds():
    proposer = make_proposer(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                                       "prompt_lookup_min": 1, "prompt_lookup_max": 3}))
    assert isinstance(proposer, NgramProposer) and (proposer.min_n, proposer.max_n) == (1, 3)

"""SpeculativeConfig: --speculative-config's JSON (vLLM's keys), validated once.

vLLM's spelling is kept so that a vLLM command line carries over: {"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_min": 2, "prompt_lookup_max": 5}, {"method": "draft_model" (or "draft"), "model": DIR, ...},
{"method": "eagle3", "model": DIR, ...}. Every method parses; `require_supported` says which the engine can run.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidConfig

FLAG = "--speculative-config"
METHODS = ("ngram", "draft", "eagle3")
# vLLM's other spellings of our methods: "draft_model" is its name for "draft", "[ngram]" an old one of "ngram".
_ALIASES = {"draft_model": "draft", "[ngram]": "ngram"}
# method → "module:class" under common.engine.spec: the proposers built. A method is added by writing its module
# and one line here; `require_supported` refuses the others by name.
PROPOSERS = {"ngram": "ngram:NgramProposer", "draft": "draft:DraftModelProposer", "eagle3": "eagle3:Eagle3Proposer"}
# A verify row is K+1 tokens; past ~16 even a 0.9 per-token acceptance (0.9**16 ≈ 0.19 at the last position) buys
# little, and every row's positions count against the step's token budget.
MAX_SPECULATIVE_TOKENS = 16
# vLLM's defaults for ngram where neither bound is given (it notes they are not tuned); one given sets the other.
DEFAULT_PROMPT_LOOKUP = 5
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "draft_tensor_parallel_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    """One of METHODS."""
    num_speculative_tokens: int
    """K: draft tokens proposed per step at most (a request's tracker may ask for fewer)."""
    prompt_lookup_min: int | None = None
    """ngram only: the shortest suffix n-gram matched against the earlier context."""
    prompt_lookup_max: int | None = None
    """ngram only: the longest, tried first."""
    model: str | None = None
    """draft / eagle3: the draft model's (or EAGLE head's) directory."""
    draft_tensor_parallel_size: int | None = None
    """draft / eagle3: ranks the draft model is sharded over (vLLM: 1 or the target's). None: the target's."""

    @property
    def supported(self) -> bool:
        return self.method in PROPOSERS

    @property
    def reads_target_hidden(self) -> bool:
        """Whether the proposer reads the target's hidden states (eagle3), which its forward then keeps."""
        return self.method == "eagle3"


def require_supported(config: SpeculativeConfig) -> None:
    """Raise InvalidConfig unless the engine has a proposer for `config.method`."""
    if not config.supported:
        raise InvalidConfig(f"{FLAG}: speculative method {config.method!r} parses but is not implemented yet; "
                            f"implemented: {', '.join(PROPOSERS)}")


def parse_speculative_config(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """The flag's JSON text (or its dict) as a SpeculativeConfig; None where it is unset ("", "null", None)."""
    if value is None or (isinstance(value, str) and value.strip() in ("", "null")):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidConfig(f"{FLAG} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidConfig(f"{FLAG} must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise InvalidConfig(f"{FLAG}: unknown key(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}")
    fields = {key: _typed(key, value.get(key)) for key in _KEYS}
    method = _method(fields["method"], fields["model"])
    k = fields["num_speculative_tokens"]
    if k is None:
        raise InvalidConfig(f"{FLAG}: num_speculative_tokens is required")
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise InvalidConfig(f"{FLAG}: num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
    tp = fields["draft_tensor_parallel_size"]
    if tp is not None and tp < 1:
        raise InvalidConfig(f"{FLAG}: draft_tensor_parallel_size must be >= 1, got {tp}")
    if method == "ngram":
        return _ngram(k, fields)
    if fields["model"] is None:
        raise InvalidConfig(f"{FLAG}: method {method!r} needs \"model\" (the draft model's directory)")
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if fields[key] is not None:
            raise InvalidConfig(f"{FLAG}: {key} applies to method 'ngram' only, not {method!r}")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, model=fields["model"],
                             draft_tensor_parallel_size=tp)


def _typed(key: str, value: Any) -> Any:
    """The key's value, checked for its JSON type (None where absent)."""
    if value is None:
        return None
    if key in ("method", "model"):
        if not isinstance(value, str) or not value:
            raise InvalidConfig(f"{FLAG}: {key} must be a non-empty string, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int):  # bool is an int in Python; JSON true is not
        raise InvalidConfig(f"{FLAG}: {key} must be an integer, got {value!r}")
    return value


def _method(method: str | None, model: str | None) -> str:
    """The canonical method; without one, inferred from the model as vLLM does ("ngram", a name with "eagle3",
    else a draft model)."""
    if method is None:
        if model is None:
            raise InvalidConfig(f"{FLAG}: give \"method\" ({', '.join(METHODS)}) or a draft \"model\"")
        if model in ("ngram", "[ngram]"):
            return "ngram"
        return "eagle3" if "eagle3" in model.lower() else "draft"
    method = _ALIASES.get(method, method)
    if method not in METHODS:
        raise InvalidConfig(f"{FLAG}: unknown method {method!r}; known: {', '.join(METHODS)} (draft_model = draft)")
    return method


def _ngram(k: int, fields: dict[str, Any]) -> SpeculativeConfig:
    if fields["model"] not in (None, "ngram", "[ngram]"):
        raise InvalidConfig(f"{FLAG}: method 'ngram' drafts from the request's own tokens and takes no model, "
                            f"got model {fields['model']!r}")
    if fields["draft_tensor_parallel_size"] is not None:
        raise InvalidConfig(f"{FLAG}: draft_tensor_parallel_size applies to a draft model, not method 'ngram'")
    low, high = fields["prompt_lookup_min"], fields["prompt_lookup_max"]
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    low, high = (high if low is None else low), (low if high is None else high)
    if low < 1:
        raise InvalidConfig(f"{FLAG}: prompt_lookup_min must be >= 1, got {low}")
    if low > high:
        raise InvalidConfig(f"{FLAG}: prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=low, prompt_lookup_max=high)

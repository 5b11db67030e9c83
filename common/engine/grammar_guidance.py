"""The llguidance backend (the Rust library behind vLLM's and TensorRT-LLM's `guidance`): a grammar compiles into one
LLMatcher, checked and kept in a small cache; each request's state is a copy of it (a copy shares the grammar and
its lexer, and costs about a microsecond); an LLExecutor fills a batch's rows on its threads. It has no form of
xgrammar's structural tags: those compile on xgrammar."""
from __future__ import annotations

import collections
import json
import threading
from typing import Any

import llguidance
import llguidance.hf
import torch

from common.engine.grammar_backend import (BatchFill, CompiledGrammar, GrammarBackend, GrammarRefused,
                                           GrammarState)
from common.engine.grammar_xgrammar import FILL_THREADS
from common.engine.structured import (CHOICE, GRAMMAR, JSON_OBJECT,
                                      JSON_SCHEMA, REGEX, SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_ONES,
                                      StructuredOutput)

CACHE_ENTRIES = 256
# xgrammar's JSON (grammar_xgrammar._COMPILE): compact, ", " and ": ", no other whitespace. Overrides: a schema's own
# "x-guidance" options cannot loosen them.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def strict(schema: Any) -> Any:
    """The schema as xgrammar's strict mode reads it: an object takes no properties but those it names, and an array
    with prefixItems no items past them, unless it says otherwise (llguidance, like JSON Schema, allows any)."""
    if not isinstance(schema, dict):
        return schema
    node = dict(schema)
    types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
    said = {"additionalProperties", "unevaluatedProperties"} & set(node)
    if ("object" in types or "properties" in node) and not said:
        node["additionalProperties"] = False
    if "prefixItems" in node and not {"items", "unevaluatedItems"} & set(node):
        node["items"] = False
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: strict(sub) for name, sub in node[key].items()}
    for key in SCHEMA_LISTS + SCHEMA_ONES:
        if isinstance(node.get(key), list):
            node[key] = [strict(sub) for sub in node[key]]
        elif key in node:
            node[key] = strict(node[key])
    return node


def _json(schema: Any) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_JSON_OPTIONS)


_GRAMMAR = {
    JSON_SCHEMA: lambda spec: _json(strict(json.loads(spec))),
    JSON_OBJECT: lambda spec: _json({"type": "object"}),
    REGEX: lambda spec: llguidance.grammar_from("regex", spec),
    CHOICE: lambda spec: llguidance.grammar_from("choice", spec),
    GRAMMAR: lambda spec: llguidance.grammar_from("grammar", spec),  # Lark, or GBNF converted to it
}


class GuidanceFill(BatchFill):
    def __init__(self) -> None:
        self._executor = llguidance.LLExecutor(None if FILL_THREADS == "auto" else FILL_THREADS)

    def fill(self, states: list[GuidanceState], bitmask: torch.Tensor, rows: list[int]) -> None:
        # llguidance.torch's fill_next_token_bitmask_par, without importing that module (its torch.compile kernel
        # costs seconds at import)
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
        batch, words = bitmask.shape
        self._executor.unsafe_compute_mask_ptr([(s.matcher, row) for s, row in zip(states, rows)],
                                               bitmask.data_ptr(), words * 4, batch)


class GuidanceState(GrammarState):
    fill_class = GuidanceFill

    def __init__(self, compiled: GuidanceCompiled):
        self.matcher = compiled.matcher.deep_copy()
        self._stop = compiled.stop
        self._ended = False

    def accept(self, token: int) -> bool:
        if not self.matcher.consume_token(token):
            return False
        self._ended = token in self._stop
        return True

    def allows(self, token: int) -> bool:
        if self.matcher.is_stopped():  # (its grammar complete: only a stop token, which validate_tokens refuses)
            return token in self._stop and not self.matcher.is_error()
        return self.matcher.validate_tokens([token]) == 1

    @property
    def terminated(self) -> bool:
        return self._ended and self.matcher.is_stopped()


class GuidanceCompiled(CompiledGrammar):
    backend = "guidance"

    def __init__(self, matcher: llguidance.LLMatcher, stop: frozenset[int]):
        self.matcher, self.stop = matcher, stop

    def state(self) -> GuidanceState:
        return GuidanceState(self)


class GuidanceBackend(GrammarBackend):
    name = "guidance"

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int]):
        # Its masks cover the logits, which must hold every token of the tokenizer: llguidance may allow only the
        # tokenizer's own tokenization of a forced text, and a token past the logits could never be drawn.
        if vocab_size < len(hf_tokenizer):
            raise ValueError(f"the model's {vocab_size} logits do not cover its tokenizer's {len(hf_tokenizer)} "
                             "tokens")
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                       eos_token=list(stop_token_ids) or None)
        self._stop = frozenset(self._tokenizer.eos_tokens)
        self._cache: collections.OrderedDict[StructuredOutput, GuidanceCompiled] = collections.OrderedDict()
        self._lock = threading.Lock()

    def takes(self, kind: str) -> bool:
        return kind in _GRAMMAR

    def compile(self, structured: StructuredOutput) -> GuidanceCompiled:
        with self._lock:
            if structured in self._cache:
                self._cache.move_to_end(structured)
                return self._cache[structured]
        try:
            grammar = _GRAMMAR[structured.kind](structured.spec)
        except ValueError as exc:  # (a GBNF grammar its converter cannot read)
            raise GrammarRefused(str(exc).strip().splitlines()[0][:500]) from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)  # (it never raises: see is_error)
        if matcher.is_error():
            raise GrammarRefused(_first_lines(matcher.get_error()))
        compiled = GuidanceCompiled(matcher, self._stop)
        with self._lock:
            self._cache[structured] = compiled
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled


def _first_lines(error: str) -> str:
    """llguidance's message up to its source excerpt ("   1 | start: /a(b/"), on one line."""
    lines = []
    for line in error.strip().splitlines():
        if line.lstrip().startswith(("1 |", "|")) or line.startswith("<state>"):
            break
        lines.append(line.strip())
    return " ".join(line for line in lines if line)[:500] or "llguidance refused it"

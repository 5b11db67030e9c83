"""The xgrammar backend: compiled grammars kept in xgrammar's cache, keyed by what was compiled (the kind's compile
call and the spec), bounded in bytes; a GrammarMatcher per request; a BatchGrammarMatcher fills a batch's rows."""
from __future__ import annotations

import json
import os
import re

import torch
import xgrammar as xgr

from common.engine.grammar_backend import (BatchFill, CompiledGrammar, GrammarBackend, GrammarRefused,
                                           GrammarState)
from common.engine.structured import (CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, STRUCTURAL_TAG,
                                      StructuredOutput)

CACHE_BYTES = 256 * 1024 * 1024
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_XGRAMMAR_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
# Threads filling a batch's masks (xgrammar's batch matcher splits the rows over them): xgrammar's own choice, which
# a bench may replace in-process before the first fill.
FILL_THREADS: int | str = "auto"


def _choice_ebnf(spec: str) -> str:
    # JSON's string escapes are EBNF's: each choice becomes one literal alternative.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec))


# One compile call per kind. JSON is compact (", " and ": ", no newlines): with any whitespace allowed, a small model
# can fill max_tokens with blank lines before the first key. json_object is an object (OpenAI's JSON mode), any keys.
_COMPILE = {
    JSON_SCHEMA: lambda c, spec: c.compile_json_schema(spec, any_whitespace=False, strict_mode=True),
    JSON_OBJECT: lambda c, spec: c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                       strict_mode=False),
    REGEX: lambda c, spec: c.compile_regex(spec),
    CHOICE: lambda c, spec: c.compile_grammar(_choice_ebnf(spec)),
    GRAMMAR: lambda c, spec: c.compile_grammar(spec),
    STRUCTURAL_TAG: lambda c, spec: c.compile_structural_tag(spec),
}


class XgrammarFill(BatchFill):
    def __init__(self) -> None:
        self._matcher = xgr.BatchGrammarMatcher(FILL_THREADS)

    def fill(self, states: list[XgrammarState], bitmask: torch.Tensor, rows: list[int]) -> None:
        self._matcher.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask, rows)


class XgrammarState(GrammarState):
    fill_class = XgrammarFill

    def __init__(self, compiled: xgr.CompiledGrammar, refused: frozenset[int]):
        self.matcher = xgr.GrammarMatcher(compiled)
        self._refused = refused  # tokens no grammar takes, refused without asking xgrammar (XgrammarBackend)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def allows(self, token: int) -> bool:
        if token in self._refused or not self.matcher.accept_token(token):
            return False
        self.matcher.rollback(1)
        return True

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class XgrammarCompiled(CompiledGrammar):
    backend = "xgrammar"

    def __init__(self, compiled: xgr.CompiledGrammar, refused: frozenset[int]):
        self.compiled, self._refused = compiled, refused

    def state(self) -> XgrammarState:
        return XgrammarState(self.compiled, self._refused)


class XgrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int]):
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids or None)
        # Special tokens but the stop tokens: no grammar takes them, and xgrammar logs a warning for each one offered
        # (GrammarState.allows asks about a model's argmax, which a random-weight model often puts on one).
        self.refused = frozenset(info.special_token_ids) - frozenset(info.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=_XGRAMMAR_THREADS, cache_limit_bytes=CACHE_BYTES)

    def takes(self, kind: str) -> bool:
        return kind in _COMPILE

    def compile(self, structured: StructuredOutput) -> XgrammarCompiled:
        try:
            return XgrammarCompiled(_COMPILE[structured.kind](self._compiler, structured.spec), self.refused)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's word for a spec it cannot compile
            raise GrammarRefused(_first_line(exc)) from None


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without its log prefix ("[10:51:38] /project/cpp/regex_converter.cc:83: ")."""
    text = _LOG_PREFIX.sub("", str(exc).strip()) or type(exc).__name__
    return text.splitlines()[0][:500]

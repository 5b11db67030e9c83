"""Compiling structured output (common.engine.structured) into xgrammar grammars for one model's tokenizer.

Compiles run on a small pool of their own, bounded in time, so that one request's big schema never stalls the
engine's steps: the async engine awaits them before the request enters the engine, and LLMEngine.add_request (scripts
and tests) waits for them. Compiled grammars stay in xgrammar's cache, keyed by what was compiled (the kind's compile
call and the spec), bounded in bytes.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import threading
from collections.abc import Iterable

import xgrammar as xgr

from common.engine.structured import (CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, STRUCTURAL_TAG,
                                      StructuredOutput)
from common.errors import FailedPrecondition, InvalidRequest
from common.tokenizer import load_tokenizer

COMPILE_TIMEOUT_S = 10.0
CACHE_BYTES = 256 * 1024 * 1024
_COMPILE_THREADS = 2  # concurrent compiles; each may use xgrammar's own threads too
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_XGRAMMAR_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))


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


class Grammars:
    """One model's grammar compiler. The tokenizer is read at the first structured request, not at start-up."""

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: Iterable[int],
                 timeout_s: float = COMPILE_TIMEOUT_S):
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the width of the model's logits, which the masks cover
        self.stop_token_ids = sorted(stop_token_ids)
        self.timeout_s = timeout_s
        self._compiler: xgr.GrammarCompiler | None = None
        # Special tokens but the stop tokens: no grammar takes them, and xgrammar logs a warning for each one offered
        # (GrammarState.allows asks about a model's argmax, which a random-weight model often puts on one).
        self.refused: frozenset[int] = frozenset()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar-compile")

    def compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        """Blocking, within the time bound."""
        future = self._pool.submit(self._compile, structured)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._too_slow(structured) from None

    async def compile_async(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        future = asyncio.wrap_future(self._pool.submit(self._compile, structured))
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            raise self._too_slow(structured) from None

    def _too_slow(self, structured: StructuredOutput) -> InvalidRequest:
        return InvalidRequest(f"compiling the {structured.describe()} took more than {self.timeout_s:g} s, the "
                              "limit; simplify it")

    def _compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        try:
            return _COMPILE[structured.kind](compiler, structured.spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's word for a spec it cannot compile
            raise InvalidRequest(f"{structured.kind} cannot be compiled: {_first_line(exc)}") from None

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                tokenizer = load_tokenizer(self.model_dir)
                if tokenizer is None:
                    raise FailedPrecondition(f"structured output needs the model's tokenizer; {self.model_dir} has "
                                             "none")
                info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                self.refused = frozenset(info.special_token_ids) - frozenset(info.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=_XGRAMMAR_THREADS,
                                                     cache_limit_bytes=CACHE_BYTES)
            return self._compiler

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without its log prefix ("[10:51:38] /project/cpp/regex_converter.cc:83: ")."""
    text = _LOG_PREFIX.sub("", str(exc).strip()) or type(exc).__name__
    return text.splitlines()[0][:500]

"""Compiling structured output (common.engine.structured) into grammars for one model's tokenizer, on the backends
of common.engine.config.GRAMMAR_BACKENDS, in the order common.engine.grammar_choice gives.

Compiles run on a small pool of their own, bounded in time, so that one request's big schema never stalls the
engine's steps: the async engine awaits them before the request enters the engine, and LLMEngine.add_request (scripts
and tests) waits for them. A spec the first backend refuses is compiled by the next; one none can compile is
InvalidRequest, each backend's reason named. Each backend keeps its own cache of compiled grammars.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import threading
import time
from collections.abc import Callable, Iterable

from common.engine.config import GRAMMAR_BACKENDS
from common.engine.grammar_backend import CompiledGrammar, GrammarBackend, GrammarRefused
from common.engine.grammar_choice import backend_order
from common.engine.structured import StructuredOutput
from common.errors import FailedPrecondition, InvalidRequest
from common.tokenizer import load_tokenizer

COMPILE_TIMEOUT_S = 10.0
_COMPILE_THREADS = 2  # concurrent compiles; each may use its library's own threads too

# (backend, outcome, seconds): outcome "compiled", "refused" or "timeout" (common.telemetry.metrics).
Observer = Callable[[str, str, float], None]


class Grammars:
    """One model's grammar compilers. The tokenizer is read at the first structured request, not at start-up, and
    each backend is made at the first grammar it compiles."""

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: Iterable[int], backend: str = "auto",
                 timeout_s: float = COMPILE_TIMEOUT_S):
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the width of the model's logits, which the masks cover
        self.stop_token_ids = sorted(stop_token_ids)
        self.backend = backend  # --structured-output-backend
        self.timeout_s = timeout_s
        self.observe: Observer | None = None
        self._tokenizer = None
        self._backends: dict[str, GrammarBackend | GrammarRefused] = {}  # made, or why it cannot be
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar-compile")

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """Blocking, within the time bound."""
        trying: list[str] = []
        future = self._pool.submit(self._compile, structured, trying)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._too_slow(structured, trying) from None

    async def compile_async(self, structured: StructuredOutput) -> CompiledGrammar:
        trying: list[str] = []
        future = asyncio.wrap_future(self._pool.submit(self._compile, structured, trying))
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            raise self._too_slow(structured, trying) from None

    def _too_slow(self, structured: StructuredOutput, trying: list[str]) -> InvalidRequest:
        on = trying[-1] if trying else backend_order(self.backend)[0]
        self._observe(on, "timeout", self.timeout_s)
        return InvalidRequest(f"compiling the {structured.describe()} ({on}) took more than {self.timeout_s:g} s, "
                              "the limit; simplify it")

    def _compile(self, structured: StructuredOutput, trying: list[str]) -> CompiledGrammar:
        refusals = []
        for name in backend_order(self.backend):
            trying.append(name)
            start = time.perf_counter()
            try:
                backend = self._get(name)
                if not backend.takes(structured.kind):  # (guidance has no structural tags)
                    continue
                compiled = backend.compile(structured)
            except GrammarRefused as exc:
                self._observe(name, "refused", time.perf_counter() - start)
                refusals.append(f"{name}: {exc}")
                continue
            self._observe(name, "compiled", time.perf_counter() - start)
            return compiled
        raise InvalidRequest(f"{structured.kind} cannot be compiled: {'; '.join(refusals)}")

    def _get(self, name: str) -> GrammarBackend:
        with self._lock:
            if name not in self._backends:
                if self._tokenizer is None:
                    self._tokenizer = load_tokenizer(self.model_dir)
                    if self._tokenizer is None:
                        raise FailedPrecondition(f"structured output needs the model's tokenizer; {self.model_dir} "
                                                 "has none")
                module, _, cls = GRAMMAR_BACKENDS[name].partition(":")
                backend_class = getattr(importlib.import_module(f"common.engine.{module}"), cls)
                try:
                    self._backends[name] = backend_class(self._tokenizer.hf, self.vocab_size, self.stop_token_ids)
                except (ValueError, TypeError, RuntimeError) as exc:  # (llguidance reads fast tokenizers only)
                    self._backends[name] = GrammarRefused(f"it cannot serve this model: {exc}")
            made = self._backends[name]
        if isinstance(made, GrammarRefused):
            raise made
        return made

    def _observe(self, backend: str, outcome: str, seconds: float) -> None:
        if self.observe is not None:
            self.observe(backend, outcome, seconds)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

"""The seam between the engine and a grammar library (common.engine.config.GRAMMAR_BACKENDS names each one).

A backend compiles a request's StructuredOutput for one model's tokenizer into a CompiledGrammar; that makes each
choice's GrammarState, which advances with every token appended to the request (the first token a context phase
sampled included) and never goes back: a preempted request keeps its tokens and so its state, and recomputing its
KV changes neither. A BatchFill writes the next-token masks of one backend's rows into the batch's bitmask, whose
layout every backend shares (int32 words, bit j of word i for token 32·i + j, 1 = allowed), so rows of different
backends are masked by one kernel.
"""
from __future__ import annotations

import abc
import logging
from typing import ClassVar

import torch

from common.engine.structured import StructuredOutput
from common.errors import HandoffMismatch

log = logging.getLogger(__name__)


class GrammarRefused(Exception):
    """A backend cannot compile this spec (its message says why, without the backend's name); Grammars tries the
    next backend and answers InvalidRequest when none can."""


class BatchFill(abc.ABC):
    """One backend's batch mask filler, kept for the engine's life (it may hold threads)."""

    @abc.abstractmethod
    def fill(self, states: list[GrammarState], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Write each state's next-token mask into its row of `bitmask` (host, int32 [batch, words])."""


class GrammarState(abc.ABC):
    """One request's place in its grammar. Once the grammar is complete it allows only stop tokens (EOS), and
    accepting one ends it."""

    fill_class: ClassVar[type[BatchFill]]

    @abc.abstractmethod
    def accept(self, token: int) -> bool:
        """Advance over `token`; False when the grammar does not take it."""

    @abc.abstractmethod
    def allows(self, token: int) -> bool:
        """Whether the grammar takes `token` next; the state stays as it was."""

    @property
    @abc.abstractmethod
    def terminated(self) -> bool:
        """The grammar took its stop token."""

    def ends_with(self, token: int) -> bool:
        """Advance over a sampled token: True when the grammar is done (it took its stop token), or could not take
        `token` (never, as the mask allowed it; the request then ends rather than leave its grammar)."""
        if not self.accept(token):
            log.warning("the grammar refused sampled token %d; the request ends", token)
            return True
        return self.terminated


class CompiledGrammar(abc.ABC):
    """A spec compiled by one backend for one tokenizer; it makes the states of the requests that use it."""

    backend: ClassVar[str]

    @abc.abstractmethod
    def state(self) -> GrammarState:
        """A fresh state, at the grammar's start."""

    def after(self, tokens: list[int]) -> GrammarState:
        """The state past `tokens` (a generation_only request's first token, sampled by the context phase under
        the same grammar); HandoffMismatch when the grammar does not allow them: the context phase broke its rule,
        which the client could not have caused."""
        state = self.state()
        for token in tokens:
            if not state.accept(token):
                raise HandoffMismatch(f"token {token} (the first token the context phase sampled) does not fit "
                                      "the request's structured output")
        return state


class GrammarBackend(abc.ABC):
    """One grammar library for one model's tokenizer. `compile` may run on several threads at once."""

    name: ClassVar[str]

    @abc.abstractmethod
    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int]):
        """`vocab_size`: the width of the model's logits, which the masks cover."""

    @abc.abstractmethod
    def takes(self, kind: str) -> bool:
        """Whether this backend has a compile for this kind of structured output at all."""

    @abc.abstractmethod
    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar; GrammarRefused when the backend cannot compile this spec."""

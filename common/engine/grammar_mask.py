"""Each structured request's place in its grammar, and the token masks it puts on a batch's logits.

A request's GrammarState advances with every token appended to it (the first token a context phase sampled
included), and never goes back: a preempted request keeps its tokens and so its state, and recomputing its KV
changes neither. Only rows with a grammar are masked; the others share the batch untouched.
"""
from __future__ import annotations

import functools
import logging

import torch
import xgrammar as xgr

from common.engine import kernels
from common.errors import InvalidRequest

log = logging.getLogger(__name__)


class GrammarState:
    """One request's xgrammar GrammarMatcher. Once the grammar is complete its mask allows only stop tokens (EOS),
    and accepting one ends it."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        self.matcher = xgr.GrammarMatcher(compiled)

    @classmethod
    def after(cls, compiled: xgr.CompiledGrammar, tokens: list[int]) -> GrammarState:
        """The state past `tokens` (a generation_only request's first token, sampled by the context phase under
        the same grammar); InvalidRequest when the grammar does not allow them."""
        state = cls(compiled)
        for token in tokens:
            if not state.matcher.accept_token(token):
                raise InvalidRequest(f"token {token} (the first token the context phase sampled) does not fit "
                                     "the request's structured output")
        return state

    def ends_with(self, token: int) -> bool:
        """Advance over a sampled token: True when the grammar is done (it took its stop token), or could not take
        `token` (never, as the mask allowed it; the request then ends rather than leave its grammar)."""
        if not self.matcher.accept_token(token):
            log.warning("the grammar refused sampled token %d; the request ends", token)
            return True
        return self.matcher.is_terminated()


@functools.cache
def _batch_matcher() -> xgr.BatchGrammarMatcher:
    return xgr.BatchGrammarMatcher()


def apply_grammar_masks(logits: torch.Tensor, grammars: list[GrammarState | None]) -> None:
    """Set to -inf, in place, each grammar row's logits of tokens its grammar does not allow next. logits [B, V].

    The masks are filled on the host before anything waits for the logits: on a GPU that work overlaps the forward
    still running there, and one copy (from pinned memory) and one kernel mask every row."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    batch, vocab = logits.shape
    cuda = logits.device.type == "cuda"
    bitmask = torch.full(xgr.get_bitmask_shape(batch, vocab), -1, dtype=xgr.bitmask_dtype, pin_memory=cuda)
    _batch_matcher().batch_fill_next_token_bitmask([grammars[i].matcher for i in rows], bitmask, rows)
    if cuda:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    # On a GPU xgrammar's kernel is triton's; where triton is not installed (a CPU image's xgrammar), its torch one.
    backend = ("triton" if kernels.HAS_TRITON else "torch_native") if cuda else "auto"
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows, backend=backend)

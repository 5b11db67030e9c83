"""Prompt lookup (n-gram) drafts: the tokens that followed an earlier occurrence of the context's own suffix.

The longest suffix n-gram (n from prompt_lookup_max down to prompt_lookup_min) that occurred earlier wins, and of
its occurrences the earliest, as vLLM's NgramProposer chooses; the draft is the up-to-k tokens after it (fewer where
the context ends first). An occurrence may overlap the suffix, never be it.

It runs on the engine thread for every speculating row every step, so the search is vectorised: the ends of the
last token's earlier occurrences, narrowed one token further back per n, so each n costs the surviving candidates,
not the context (vLLM runs a KMP longest-prefix-suffix scan under numba, which we do not depend on).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.engine.spec.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min}, {prompt_lookup_max}")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target=None) -> "NgramProposer":
        return cls(config.prompt_lookup_min, config.prompt_lookup_max)

    def close(self) -> None:
        pass  # (nothing beside the target)

    def forget(self, request_id: str) -> None:
        pass  # (nothing kept per request)

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int) -> list[int]:
        """Up to k draft tokens for a request whose prompt + output so far is `token_ids`; [] where no n-gram of
        the allowed lengths recurs (or k < 1). A list is copied into an array first (~0.1 ms for 4k tokens, more
        than the search): the engine passes a request's TokenHistory instead."""
        if not isinstance(token_ids, np.ndarray):
            token_ids = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
        return propose_ngram(token_ids, self.min_n, self.max_n, k)


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """NgramProposer.propose on a 1-D integer array."""
    length = tokens.shape[0]
    if k < 1 or length <= min_n:
        return []
    # Ends of earlier occurrences of the last 1 token (never the last position itself: something must follow).
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    best_end = -1
    for n in range(1, max_n + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
        if ends.size == 0:
            break
        if n >= min_n:
            best_end = int(ends[0])  # ascending: the earliest occurrence of the longest n so far
    if best_end < 0:
        return []
    return tokens[best_end + 1: best_end + 1 + k].tolist()

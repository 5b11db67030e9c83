"""A request's prompt + output as one growing int64 array, for proposers that search the whole context.

Converting a 4k-token list to an array each step costs more than the n-gram search itself; this converts each
token once, as vLLM's input batch keeps its token_ids_cpu rows.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TokenHistory:
    def __init__(self, prompt_token_ids: Sequence[int]):
        self._prompt_len = len(prompt_token_ids)
        self._tokens = np.empty(max(64, 2 * self._prompt_len), dtype=np.int64)
        self._tokens[: self._prompt_len] = prompt_token_ids
        self._len = self._prompt_len

    def __len__(self) -> int:
        return self._len

    def update(self, output_token_ids: Sequence[int]) -> np.ndarray:
        """The prompt + `output_token_ids` (the request's output so far: only tokens past those seen are copied),
        as a view valid until the next update."""
        seen = self._len - self._prompt_len
        if len(output_token_ids) < seen:
            raise ValueError(f"output shrank from {seen} to {len(output_token_ids)} tokens")
        new = output_token_ids[seen:]
        if self._len + len(new) > self._tokens.shape[0]:  # doubling: each token copied O(1) times in all
            grown = np.empty(2 * (self._len + len(new)), dtype=np.int64)
            grown[: self._len] = self._tokens[: self._len]
            self._tokens = grown
        self._tokens[self._len: self._len + len(new)] = new
        self._len += len(new)
        return self._tokens[: self._len]

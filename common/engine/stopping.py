"""When a request stops, on token ids and lengths: EOS (unless ignore_eos), stop token ids, max_tokens,
the context limit. Stop strings are text, matched by the text stream's owner (common.text_stream).

One rule for the engine (every sampled token) and the router (the first token prefill sampled).
Torch-free.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from common.engine.request import FinishReason, SamplingParams


@dataclass(frozen=True)
class StopRule:
    stop_token_ids: frozenset[int]
    max_total_tokens: int  # prompt + output

    @classmethod
    def of(cls, sampling: SamplingParams, eos_token_ids: Iterable[int], num_prompt_tokens: int,
           token_limit: int) -> StopRule:
        """token_limit: the most tokens (prompt + output) the request may hold, max_tokens aside."""
        # A grammar's output ends at EOS even with ignore_eos: the grammar allows nothing after it.
        keep_eos = not sampling.ignore_eos or sampling.structured is not None
        ids = set(sampling.stop_token_ids) | (set(eos_token_ids) if keep_eos else set())
        limit = token_limit if sampling.max_tokens is None else min(token_limit,
                                                                    num_prompt_tokens + sampling.max_tokens)
        return cls(frozenset(ids), limit)

    def check(self, token: int, num_tokens: int) -> FinishReason | None:
        """Whether `token`, just appended and making the request `num_tokens` long, ends it."""
        if token in self.stop_token_ids:
            return FinishReason.STOP
        if num_tokens >= self.max_total_tokens:
            return FinishReason.LENGTH
        return None

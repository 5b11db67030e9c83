"""Speculative decoding's counts: drafts verified, draft tokens proposed and accepted (all and by position), and
steps that ran without drafts, each by method.

Kept here (for tests and logs) and, once a worker binds its Prometheus metrics (`bind`), counted there too under
the names common.telemetry.metrics.METRICS gives them. Rates are left to PromQL, as vLLM's are:
acceptance = accepted_tokens / draft_tokens, mean accepted length = 1 + accepted_tokens / drafts (the target's own
token counted), acceptance at position i = accepted_tokens_per_pos{position=i} / drafts. Called from the engine
thread; read from others.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from common.telemetry.counts import Counts

PLAIN_REASONS = ("off", "no_draft")


class SpecMetrics(Counts):
    def verified(self, method: str, proposed: Sequence[int], accepted: Sequence[int]) -> None:
        """A step's verified rows: each row's draft tokens proposed and accepted (rows without drafts ignored)."""
        rows = [(n, a) for n, a in zip(proposed, accepted, strict=True) if n > 0]
        if not rows:
            return
        by_position: Counter = Counter()
        for _, a in rows:
            by_position.update(range(a))
        self.count("disagg_spec_decode_drafts_total", len(rows), method=method)
        self.count("disagg_spec_decode_draft_tokens_total", sum(n for n, _ in rows), method=method)
        self.count("disagg_spec_decode_accepted_tokens_total", sum(a for _, a in rows), method=method)
        for position, count in by_position.items():
            self.count("disagg_spec_decode_accepted_tokens_per_pos_total", count, method=method,
                       position=str(position))

    def plain(self, method: str, reason: str, steps: int = 1) -> None:
        """`steps` request-steps run without drafts, for `reason` (PLAIN_REASONS)."""
        if reason not in PLAIN_REASONS:
            raise ValueError(f"reason {reason!r} is not one of {PLAIN_REASONS}")
        self.count("disagg_spec_decode_plain_steps_total", steps, method=method, reason=reason)

    def mean_accepted_length(self, method: str) -> float:
        """Tokens a verified draft emitted on average, the target's own included (1.0 before any)."""
        drafts = self.total("disagg_spec_decode_drafts_total", method=method)
        return 1.0 + self.total("disagg_spec_decode_accepted_tokens_total", method=method) / drafts if drafts else 1.0

    def acceptance_by_position(self, method: str, k: int) -> list[float]:
        """The share of verified drafts whose token at each position 0..k-1 was accepted."""
        drafts = self.total("disagg_spec_decode_drafts_total", method=method)
        return [self.total("disagg_spec_decode_accepted_tokens_per_pos_total", method=method, position=str(i)) / drafts
                if drafts else 0.0 for i in range(k)]

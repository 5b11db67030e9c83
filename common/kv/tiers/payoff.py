"""Whether a hit in a lower tier pays: onboarding its blocks against computing their tokens, as this engine measures
both. A tier that would make a request wait longer than its prefill is skipped (the request recomputes, the same
tokens); one that gets cheap again is found by probing.

The rule. A request's blocks past its device hit are in chain order, each in some tier t. Onboarding block i costs
c(t_i) seconds, computing it P seconds (the engine's prefill seconds a token times the block size). The request
takes the longest prefix of its blocks that saves the most, max over L of sum_{i<L} (P - c(t_i)): all of them where
every tier is cheaper than computing, none where the first is dearer, and the host tier's blocks without the disk's
after them where only the host pays. Until a prefill has been measured there is nothing to compare with: every hit is
taken (a fresh engine behaves as it did without this rule).

The estimate. c(t) is what a request saw: the seconds admission held it back for its prefetch (from when it could
first have been admitted to when its blocks were staged) plus the engine thread's own fetch and install, over its
blocks, in sums whose weight halves every `half_life_blocks` blocks onboarded, with a prior of `prior_blocks` blocks
at `prior_ratio` of P (the router's "half a computed block" before a measurement). A prefetch that ran past its wait
bound counts as the seconds it was waited for plus those of computing its blocks after all (2P a block at the
bound): a tier too slow for the bound looks dearer than computing. Skipped blocks age a tier's evidence at
`idle_half_life_blocks`: the prior regains weight until c(t) falls below P and a request probes the tier; a probe
that is still dear stops it again. A prefetch hidden behind the request's own wait in the queue costs little, so a
loaded engine keeps its hits where an idle one computes.
"""
from __future__ import annotations

from dataclasses import dataclass

PREFILL_WEIGHT = 0.1  # the running mean's weight of each new prefill step


@dataclass(frozen=True)
class PayoffPolicy:
    half_life_blocks: float = 64.0
    """Blocks onboarded after which a measurement counts half."""
    idle_half_life_blocks: float = 512.0
    """Blocks skipped after which a tier's evidence counts half (how soon a skipped tier is probed again)."""
    prior_ratio: float = 0.5
    prior_blocks: float = 16.0
    """The prior: onboarding a block costs prior_ratio of computing it, weighted as prior_blocks blocks."""

    def __post_init__(self):
        if self.half_life_blocks <= 0 or self.idle_half_life_blocks <= 0 or self.prior_blocks <= 0:
            raise ValueError("half lives and the prior's weight must be positive")
        if self.prior_ratio < 0:
            raise ValueError(f"prior_ratio must be >= 0, got {self.prior_ratio}")


class OnboardPayoff:
    """The engine's prefill cost and each tier's onboarding cost, and the decision from them. Engine thread."""

    def __init__(self, block_size: int, policy: PayoffPolicy = PayoffPolicy()):
        self.block_size, self.policy = block_size, policy
        self.prefill_s_per_token: float | None = None
        self._seconds: dict[str, float] = {}  # tier -> weighted seconds onboarding took
        self._blocks: dict[str, float] = {}  # and the weighted blocks they brought

    def prefill(self, tokens: int, seconds: float) -> None:
        """A prompt-only step computed `tokens` in `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        per_token = seconds / tokens
        self.prefill_s_per_token = per_token if self.prefill_s_per_token is None else (
            (1 - PREFILL_WEIGHT) * self.prefill_s_per_token + PREFILL_WEIGHT * per_token)

    @property
    def compute_s_per_block(self) -> float | None:
        return None if self.prefill_s_per_token is None else self.prefill_s_per_token * self.block_size

    def onboarded(self, tier: str, blocks: int, seconds: float) -> None:
        """`blocks` of `tier` took a request `seconds` to onboard (its wait, fetch and install)."""
        if blocks <= 0:
            return
        decay = 0.5 ** (blocks / self.policy.half_life_blocks)
        self._seconds[tier] = decay * self._seconds.get(tier, 0.0) + seconds
        self._blocks[tier] = decay * self._blocks.get(tier, 0.0) + blocks

    def skipped(self, tier: str, blocks: int) -> None:
        """`blocks` of `tier` were computed instead: its evidence ages toward the prior."""
        if blocks > 0 and tier in self._blocks:
            decay = 0.5 ** (blocks / self.policy.idle_half_life_blocks)
            self._seconds[tier] *= decay
            self._blocks[tier] *= decay

    def measured(self, tier: str) -> bool:
        """Whether a request has onboarded blocks of `tier` (else its estimate is the prior alone)."""
        return tier in self._blocks

    def onboard_s_per_block(self, tier: str) -> float | None:
        """The estimated seconds a block of `tier` costs to onboard (None: no prefill measured yet)."""
        compute = self.compute_s_per_block
        if compute is None:
            return None
        p = self.policy
        return ((self._seconds.get(tier, 0.0) + p.prior_blocks * p.prior_ratio * compute)
                / (self._blocks.get(tier, 0.0) + p.prior_blocks))

    def take(self, tiers: list[str]) -> int:
        """How many of a request's blocks (in chain order, each in the tier named) to onboard; the others are
        computed, counted as skipped for the probes."""
        compute = self.compute_s_per_block
        if compute is None:
            return len(tiers)
        cost = {t: self.onboard_s_per_block(t) for t in set(tiers)}
        best, best_at, saved = 0.0, 0, 0.0
        for i, tier in enumerate(tiers):
            saved += compute - cost[tier]
            if saved > best:
                best, best_at = saved, i + 1
        for tier in set(tiers[best_at:]):
            self.skipped(tier, tiers[best_at:].count(tier))
        return best_at

    def wait_bound_s(self, blocks: int, default_s: float) -> float:
        """How long admission may hold a request for its prefetch of `blocks`: what computing them would take (at
        most `default_s`, which also stands until a prefill has been measured)."""
        compute = self.compute_s_per_block
        return default_s if compute is None else min(default_s, blocks * compute)

"""Each request's K for its next step, from how its drafts have fared: speculation only where it pays.

The rule. Model a request's drafts as accepted one after another, each with probability `a` (its acceptance
rate) until the first rejection. A step with k drafts then emits
    E(k, a) = 1 + a + a^2 + ... + a^k        tokens (the target's own token always; draft i only if 1..i were),
and costs c(k) times a plain decode row (c(0) = 1: the K+1-token verify row and its drafting, as the engine
measures them). Time per emitted token is c(k) / E(k, a), so the request's next K is
    argmax over k in 0..max_k of E(k, a) / c(k),
which is 0 (no speculation) unless some k emits more than one token per plain step's cost. K shrinks as `a`
falls and reaches 0 where a < c(1) - 1 and no longer k pays either.

The estimate. `a` is the share of draft positions tried that were accepted (a step with n drafts and m accepted
tried m + 1 of them, or n if all were accepted), in exponentially weighted sums (each step's weight halves every
`half_life` verified steps) with a Beta-like prior of `prior_weight` tried positions at `prior_rate`, so a new
request starts from the prior and a few steps of its own outweigh it. A step without drafts (K = 0, or the proposer
found none) ages the evidence instead, at `idle_half_life`: the prior regains weight, the estimate climbs back
to where K = 1 pays, and the request probes with one draft; a failed probe stops it again. Re-checking costs
about c(1) - 1 - a per probe. The half lives trade noise against lag: with the defaults a simulated request of
steady acceptance gets within ~3 % of the best fixed K's tokens per unit cost (acceptance 0.02-0.95, a draft
costing 0.05-0.4 of a plain step), and one whose drafts always fail probes about every 20 steps.

The model ignores that n-gram drafts tend to be right or wrong in runs (a copied span goes on or does not), which
makes it cautious about long K; per-position acceptance is in the metrics for a better model to be fitted from.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# best_k is tabulated over the acceptance rate at this many points: next_k is a lookup, not a search, for every
# speculating row every step (the rate's grid step of ~0.001 moves K only at its boundaries).
_RATE_GRID = 1024


def expected_tokens(rate: float, k: int) -> float:
    """E(k, a): tokens a step with k drafts emits, each draft accepted with probability `rate` after the last."""
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


@dataclass(frozen=True)
class AcceptancePolicy:
    step_cost: tuple[float, ...]
    """step_cost[k]: a step with k drafts over a plain decode step, for k = 0..max_k (step_cost[0] == 1)."""
    half_life: float = 16.0
    """Verified steps after which a step's acceptance counts half."""
    idle_half_life: float = 64.0
    """Steps without drafts after which the evidence counts half (how soon a stopped request probes again)."""
    prior_rate: float = 0.5
    prior_weight: float = 1.0
    """The prior, as this many tried draft positions at prior_rate."""
    _best: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.step_cost or self.step_cost[0] != 1.0:
            raise ValueError(f"step_cost[0] must be 1.0 (a plain step), got {self.step_cost[:1]}")
        if any(c <= 0 for c in self.step_cost):
            raise ValueError(f"step costs must be positive, got {self.step_cost}")
        if self.half_life <= 0 or self.idle_half_life <= 0:
            raise ValueError("half lives must be positive")
        if not 0.0 <= self.prior_rate <= 1.0 or self.prior_weight <= 0:
            raise ValueError("prior_rate must be in [0, 1] and prior_weight positive")
        table = tuple(self._argmax(i / (_RATE_GRID - 1)) for i in range(_RATE_GRID))
        object.__setattr__(self, "_best", table)

    @classmethod
    def linear(cls, max_k: int, cost_per_draft: float, **kwargs) -> "AcceptancePolicy":
        """Costs growing by `cost_per_draft` (of a plain step) with each draft: 1 + cost_per_draft * k."""
        return cls(step_cost=tuple(1.0 + cost_per_draft * k for k in range(max_k + 1)), **kwargs)

    @property
    def max_k(self) -> int:
        return len(self.step_cost) - 1

    def best_k(self, rate: float) -> int:
        """The k that emits the most tokens per unit of cost at acceptance `rate` (0: speculation does not pay)."""
        return self._best[round(min(max(rate, 0.0), 1.0) * (_RATE_GRID - 1))]

    def _argmax(self, rate: float) -> int:
        gains = [expected_tokens(rate, k) / cost for k, cost in enumerate(self.step_cost)]
        best = max(range(len(gains)), key=lambda k: (gains[k], -k))  # ties: the smaller k
        return best if gains[best] > 1.0 else 0


class AcceptanceTracker:
    """One request's acceptance estimate; the engine asks `next_k` before a step and `record`s every step."""

    def __init__(self, policy: AcceptancePolicy):
        self.policy = policy
        self._decay = 0.5 ** (1.0 / policy.half_life)
        self._idle_decay = 0.5 ** (1.0 / policy.idle_half_life)
        self._accepted = 0.0  # weighted draft positions accepted
        self._tried = 0.0  # and tried

    @property
    def rate(self) -> float:
        p = self.policy
        return (self._accepted + p.prior_weight * p.prior_rate) / (self._tried + p.prior_weight)

    def next_k(self) -> int:
        """Draft tokens to propose for this request's next step (0: run it as a plain decode row)."""
        return self.policy.best_k(self.rate)

    def record(self, proposed: int, accepted: int) -> None:
        """A step's outcome: `proposed` drafts verified (0 where it had none), `accepted` of them taken."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted {accepted} of {proposed} drafts")
        if proposed == 0:
            self._accepted *= self._idle_decay
            self._tried *= self._idle_decay
            return
        tried = accepted + (accepted < proposed)
        self._accepted = self._decay * self._accepted + accepted
        self._tried = self._decay * self._tried + tried

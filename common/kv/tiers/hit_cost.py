"""What a hit in each tier costs this engine against computing the block, for the router (KvIndex scores a tier's
block 1 - that cost): OnboardPayoff's estimate of the tier's onboarding seconds a block (what requests that took a
hit waited and spent on it) over its prefill seconds a block, the figures the engine decides by whether to take a
hit at all. Published as a KV event (KvEventLog.hit_cost) once the tier has been measured and the prefill too, and
when the cost moves by more than CHANGE; the router takes half a computed block until then."""
from __future__ import annotations

from common.kv.events import KvEventLog
from common.kv.tiers.payoff import OnboardPayoff

CHANGE = 0.1  # a relative move that is worth an event


class HitCostReporter:
    def __init__(self, tiers: list[str], events: KvEventLog, payoff: OnboardPayoff):
        self.tiers, self.events, self.payoff = tiers, events, payoff
        self.published: dict[str, float] = {}

    def publish(self) -> None:
        """After a prompt-only step fed the prefill cost (engine thread): any tier's cost that moved is published."""
        for tier in self.tiers:
            cost = self.cost(tier)
            last = self.published.get(tier)
            if cost is not None and (last is None or abs(cost - last) > CHANGE * last):
                self.published[tier] = cost
                self.events.hit_cost(tier, cost)

    def cost(self, tier: str) -> float | None:
        """Onboard seconds a block over prefill seconds a block (None until both were measured)."""
        compute = self.payoff.compute_s_per_block
        if compute is None or not self.payoff.measured(tier):
            return None
        return self.payoff.onboard_s_per_block(tier) / compute

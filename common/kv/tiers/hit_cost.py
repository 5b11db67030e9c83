"""What a hit in each tier costs this engine against computing the block, as it measured both, for the router
(KvIndex scores a tier's block 1 - that cost): the tiers' onboard seconds a block (TierMetrics: read, verified,
copied in) over the engine's prefill seconds a block (OnboardPayoff's running mean of its prompt-only steps, wall
seconds a token times the block size). Published as a KV event (KvEventLog.hit_cost) when a tier's cost first exists
and when it moves by more than CHANGE; the router takes half a computed block until then."""
from __future__ import annotations

from common.kv.events import KvEventLog
from common.kv.tiers.metrics import TierMetrics
from common.kv.tiers.payoff import OnboardPayoff

CHANGE = 0.1  # a relative move that is worth an event


class HitCostReporter:
    def __init__(self, tiers: list[str], metrics: TierMetrics, events: KvEventLog, payoff: OnboardPayoff):
        self.tiers, self.metrics, self.events, self.payoff = tiers, metrics, events, payoff
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
        blocks = self.metrics.total("disagg_kv_tier_hit_blocks_total", tier=tier)
        seconds = self.metrics.total("disagg_kv_tier_onboard_seconds_sum", tier=tier)
        compute = self.payoff.compute_s_per_block
        if not blocks or compute is None:
            return None
        return (seconds / blocks) / compute

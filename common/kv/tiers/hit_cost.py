"""What a hit in each tier costs this engine against computing the block, as it measured both, for the router
(KvIndex scores a tier's block 1 - that cost): the tiers' onboard seconds a block (TierMetrics: read, verified,
copied in) over the engine's prefill seconds a block (its prompt-only steps, wall seconds a token times the block
size). Published as a KV event (KvEventLog.hit_cost) when a tier's cost first exists and when it moves by more than
CHANGE; the router takes half a computed block until then."""
from __future__ import annotations

from common.kv.events import KvEventLog
from common.kv.tiers.metrics import TierMetrics

CHANGE = 0.1  # a relative move that is worth an event
PREFILL_WEIGHT = 0.1  # the running mean's weight of each new prefill step


class HitCostReporter:
    def __init__(self, tiers: list[str], metrics: TierMetrics, events: KvEventLog, block_size: int):
        self.tiers, self.metrics, self.events, self.block_size = tiers, metrics, events, block_size
        self.prefill_s_per_token: float | None = None
        self.published: dict[str, float] = {}

    def observe(self, kind: str, tokens: int, seconds: float) -> None:
        """After each engine step (engine thread), its kind ("prefill": prompt chunks alone), new tokens and wall
        seconds: prompt-only steps update the prefill cost; then any tier's cost that moved is published."""
        if kind != "prefill" or tokens <= 0 or seconds <= 0:
            return
        per_token = seconds / tokens
        self.prefill_s_per_token = per_token if self.prefill_s_per_token is None else (
            (1 - PREFILL_WEIGHT) * self.prefill_s_per_token + PREFILL_WEIGHT * per_token)
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
        if not blocks or self.prefill_s_per_token is None:
            return None
        return (seconds / blocks) / (self.prefill_s_per_token * self.block_size)

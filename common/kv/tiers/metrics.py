"""The tiers' counts: hits and bytes per tier, onboard / offload seconds, evictions, failed checks and failed stores.

Kept here (for tests and logs) and, once a worker binds its Prometheus metrics (`bind`), counted there too under the
names of common.telemetry.metrics.METRICS. Called from the engine thread and the tiers' mover thread.
"""
from __future__ import annotations

from common.telemetry.counts import Counts


class TierMetrics(Counts):
    def hit(self, tier: str, blocks: int, tokens: int, nbytes: int, seconds: float) -> None:
        self.count("disagg_kv_tier_hit_blocks_total", blocks, tier=tier)
        self.count("disagg_kv_tier_hit_tokens_total", tokens, tier=tier)
        self.count("disagg_kv_tier_onboard_bytes_total", nbytes, tier=tier)
        self.observe("disagg_kv_tier_onboard_seconds", seconds, tier=tier)

    def offloaded(self, tier: str, blocks: int, nbytes: int, seconds: float) -> None:
        self.count("disagg_kv_tier_offload_blocks_total", blocks, tier=tier)
        self.count("disagg_kv_tier_offload_bytes_total", nbytes, tier=tier)
        self.observe("disagg_kv_tier_offload_seconds", seconds, tier=tier)

    def evicted(self, tier: str, blocks: int = 1) -> None:
        self.count("disagg_kv_tier_evictions_total", blocks, tier=tier)

    def rejected(self, tier: str, reason: str) -> None:
        """A stored block failed a check on its way up: recomputed instead."""
        self.count("disagg_kv_tier_recomputes_total", tier=tier, reason=reason)

    def store_failed(self, tier: str, reason: str, blocks: int = 1) -> None:
        self.count("disagg_kv_tier_offload_failures_total", blocks, tier=tier, reason=reason)

    def used(self, tier: str, nbytes: int) -> None:
        self.set("disagg_kv_tier_used_bytes", nbytes, tier=tier)

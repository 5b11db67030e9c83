"""The tiers' counts: hits and bytes per tier, onboard / offload seconds, evictions, failed checks and failed stores.

Kept here (for tests and logs) and, once a worker binds its Prometheus metrics (`bind`), counted there too under the
names of common.telemetry.metrics.METRICS. Called from the engine thread and the tiers' mover thread.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any


class TierMetrics:
    def __init__(self):
        self.totals: Counter = Counter()
        self._sink: Any = None
        self._lock = threading.Lock()

    def bind(self, sink: Any) -> None:
        """Count in `sink` from now on: an object whose get(name, **labels) is a Prometheus child
        (common.telemetry.metrics.Metrics)."""
        self._sink = sink

    def total(self, name: str, **labels: str) -> float:
        return self.totals[_key(name, labels)]

    def count(self, name: str, amount: float = 1, **labels: str) -> None:
        if not amount:
            return
        with self._lock:
            self.totals[_key(name, labels)] += amount
        if self._sink is not None:
            self._sink.get(name, **labels).inc(amount)

    def observe(self, name: str, seconds: float, **labels: str) -> None:
        with self._lock:
            self.totals[_key(name + "_count", labels)] += 1
            self.totals[_key(name + "_sum", labels)] += seconds
        if self._sink is not None:
            self._sink.get(name, **labels).observe(seconds)

    def set(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self.totals[_key(name, labels)] = value
        if self._sink is not None:
            self._sink.get(name, **labels).set(value)

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


def _key(name: str, labels: dict[str, str]) -> tuple:
    """A series' key in `totals`: its name and its labels in name order."""
    return (name, *sorted(labels.items()))

"""Counts kept in the process (for tests and logs) and, once a worker binds its Prometheus metrics (`bind`), counted
there too under the names of common.telemetry.metrics.METRICS: the base of a component's metrics (the KV tiers',
speculative decoding's), which adds the methods that say what happened. Thread-safe: components count from the
engine thread and their own.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any


class Counts:
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


def _key(name: str, labels: dict[str, str]) -> tuple:
    """A series' key in `totals`: its name and its labels in name order."""
    return (name, *sorted(labels.items()))

"""The decode workers' engine steps over a window, from a scrape of their /metrics before and after it (the
disagg_engine_step_* series, benchmarks.scrape's keys): the step period (start to start while the engine stayed busy:
what a token's ITL is made of), its quantiles read from the histogram's buckets as Prometheus' histogram_quantile reads
them (linear within a bucket), the steps' wall and engine-thread CPU time, and how many periods began with a step that
had not been launched ahead (async scheduling's pipeline broken: a request joined or the batch changed) or with a mixed
step (a prompt chunk beside the decode rows)."""
from __future__ import annotations

import math
import re

PERIOD = "disagg_engine_step_period_seconds"
STEP = "disagg_engine_step_seconds"
CPU = "disagg_engine_step_cpu_seconds_total"
SEQUENCES = "disagg_engine_step_sequences_total"
_KEY = re.compile(r"^(?P<name>[^{]+)(?:\{(?P<labels>.*)\})?$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _series(samples: dict[str, float], name: str) -> list[tuple[dict[str, str], float]]:
    found = []
    for key, value in samples.items():
        match = _KEY.match(key)
        if match and match["name"] == name:
            found.append((dict(_LABEL.findall(match["labels"] or "")), value))
    return found


def window(after: list[dict[str, float]], before: list[dict[str, float]]) -> dict[str, float]:
    """The step series' increase over a window, summed over workers (each worker's scrape after and before)."""
    total: dict[str, float] = {}
    for now, was in zip(after, before):
        for key, value in now.items():
            if key.startswith("disagg_engine_step_"):
                total[key] = total.get(key, 0.0) + value - was.get(key, 0.0)
    return total


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name` over its series whose labels include `labels`."""
    return sum(v for series, v in _series(samples, name) if labels.items() <= series.items())


def buckets(samples: dict[str, float], histogram: str, **labels: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of `histogram`, summed over its series whose labels include `labels`."""
    by_bound: dict[float, float] = {}
    for series, value in _series(samples, histogram + "_bucket"):
        if labels.items() <= series.items():
            bound = float(series["le"])
            by_bound[bound] = by_bound.get(bound, 0.0) + value
    return sorted(by_bound.items())


def quantile(cumulative: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of a histogram's buckets, linear within the bucket it falls in (None: no observation)."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank, lower, below = q * cumulative[-1][1], 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if math.isinf(bound):
                return lower  # past the last finite bound: its bound, as Prometheus says
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = bound, count
    return lower


def count_above(cumulative: list[tuple[float, float]], x: float) -> float:
    """How many observations exceed `x`, linear within its bucket."""
    if not cumulative:
        return 0.0
    lower, below = 0.0, 0.0
    for bound, count in cumulative:
        if x < bound:
            if math.isinf(bound):
                return cumulative[-1][1] - below
            return cumulative[-1][1] - (below + (count - below) * (x - lower) / (bound - lower))
        lower, below = bound, count
    return 0.0


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def step_summary(delta: dict[str, float], min_periods: int = 10) -> dict | None:
    """A window's decode steps (`window`'s increase of every decode worker's step series): see the module."""
    periods = buckets(delta, PERIOD)
    count = periods[-1][1] if periods else 0.0
    if count < min_periods:
        return None
    p50 = quantile(periods, 0.5)
    steps = total(delta, STEP + "_count")
    summary = {"steps": int(count), "period_p50_ms": _ms(p50), "period_p90_ms": _ms(quantile(periods, 0.9)),
               "period_p99_ms": _ms(quantile(periods, 0.99)),
               "period_mean_ms": _ms(total(delta, PERIOD + "_sum") / count),
               "step_wall_mean_ms": _ms(total(delta, STEP + "_sum") / steps) if steps else None,
               "step_cpu_mean_ms": _ms(total(delta, CPU) / steps) if steps else None,
               "mean_sequences": round(total(delta, SEQUENCES) / steps, 1) if steps else None,
               "not_ahead_share": round(total(delta, PERIOD + "_count", launched_ahead="no") / count, 3),
               "long": round(count_above(periods, 2.5 * p50)),
               "long_not_ahead": round(count_above(buckets(delta, PERIOD, launched_ahead="no"), 2.5 * p50))}
    mixed = buckets(delta, PERIOD, kind="mixed")
    if mixed and mixed[-1][1]:  # a decode worker prefilling a prompt itself (+q): how long its mixed steps make the gaps
        summary.update({"mixed_share": round(mixed[-1][1] / count, 3), "mixed_p50_ms": _ms(quantile(mixed, 0.5)),
                        "mixed_p99_ms": _ms(quantile(mixed, 0.99))})
    return summary

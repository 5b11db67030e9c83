"""Each layout's predicted TTFT, ITL and goodput for a workload and an SLO, and the ranking.

Goodput here is the highest request rate at which the layout still meets every term of the SLO (each latency's
quantile within its limit), found by simulating the same requests at rising rates (doubling until the SLO breaks,
then bisecting). At the workload's own rate the figures are given as they are predicted there; a layout whose
goodput is below that rate does not meet the SLO at it. The ranking: layouts meeting the SLO at the workload's
rate first, then by goodput.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.planner.layouts import Layout
from services.planner.profile import Profile, StepCosts
from services.planner.simulate import SimResult, make_requests, simulate
from services.planner.workload import Slo, Workload

DEFAULT_REQUESTS = 1000
_DOUBLINGS = 16
_BISECTIONS = 8
# A rate is met only while the layout keeps up with it: the last quarter's mean end-to-end latency at most this many
# times the second quarter's (SimResult.backlog_growth).
MAX_BACKLOG_GROWTH = 1.5
SPAN_OVER_E2E = 5.0
MAX_REQUESTS = 5000


@dataclass(frozen=True)
class Figures:
    rate: float
    values: dict[str, float]  # each SLO term's figure (seconds), and ttft_p50 / itl_p50 / throughput
    meets: bool


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    goodput: float  # req/s: the highest rate meeting the SLO (0: none)
    at_rate: Figures | None  # at the workload's rate, where it has one
    at_goodput: Figures | None  # at the goodput rate

    def to_dict(self) -> dict:
        return {"layout": self.layout.describe(), "goodput_rps": round(self.goodput, 4),
                "at_rate": _figures_dict(self.at_rate), "at_goodput": _figures_dict(self.at_goodput)}


def _figures_dict(f: Figures | None) -> dict | None:
    if f is None:
        return None
    return {"rate_rps": round(f.rate, 4), "meets": f.meets, **{k: round(v, 6) for k, v in f.values.items()}}


def figures(result: SimResult, slo: Slo) -> dict[str, float]:
    ttft, e2e = result.ttft(), result.e2e()
    out = {"ttft_p50": float(np.percentile(ttft, 50)), "itl_p50": result.itl_quantile(50),
           "throughput_rps": len(result.requests) / result.duration_s if result.duration_s else 0.0}
    for term in slo.terms:
        if term.metric == "ttft":
            out[term.name] = float(np.percentile(ttft, term.quantile))
        elif term.metric == "e2e":
            out[term.name] = float(np.percentile(e2e, term.quantile))
        else:
            out[term.name] = result.itl_quantile(term.quantile)
    return out


class Predictor:
    """Simulates layouts of one profile for one workload and SLO, `requests` requests a run, from `seed`."""

    def __init__(self, profile: Profile, workload: Workload, slo: Slo, requests: int = DEFAULT_REQUESTS,
                 seed: int = 0):
        self.profile, self.workload, self.slo = profile, workload, slo
        self.requests, self.seed = requests, seed
        self._costs: dict[str, StepCosts] = {}

    def costs(self, unit: str) -> StepCosts:
        if unit not in self._costs:
            self._costs[unit] = self.profile.costs(unit)
        return self._costs[unit]

    def at(self, layout: Layout, rate: float) -> Figures:
        """The figures at `rate`, from a run whose arrivals span at least SPAN_OVER_E2E times the median request's
        end-to-end latency (more requests than asked where needed, up to MAX_REQUESTS): a run shorter than its
        requests' own latency ends before an overloaded layout's queue shows."""
        units = [self.costs(u) for u in layout.units]
        count = self.requests
        while True:
            requests = make_requests(self.workload, count, rate, self.seed)
            sim = simulate(units[:layout.prefill], units[layout.prefill:], layout.max_local_prefill_tokens, requests)
            wanted = SPAN_OVER_E2E * float(np.median(sim.e2e())) / max(requests[-1].arrival, 1e-9)
            if wanted <= 1 or count >= MAX_REQUESTS:
                break
            count = min(MAX_REQUESTS, int(count * wanted * 1.1) + 1)
        values = figures(sim, self.slo)
        values["backlog_growth"] = sim.backlog_growth()
        meets = values["backlog_growth"] <= MAX_BACKLOG_GROWTH and all(
            values[t.name] <= t.limit_s for t in self.slo.terms)
        return Figures(rate, values, meets)

    def goodput(self, layout: Layout) -> tuple[float, Figures | None]:
        rate = self.workload.rate or 1.0
        first = self.at(layout, rate)
        ok, bad = (first, None) if first.meets else (None, first)
        for _ in range(_DOUBLINGS):
            if ok is not None and bad is not None:
                break
            rate = rate * 2 if bad is None else rate / 2
            probe = self.at(layout, rate)
            ok, bad = (probe, bad) if probe.meets else (ok, probe)
        if ok is None:
            return 0.0, None
        if bad is None:
            return ok.rate, ok
        for _ in range(_BISECTIONS):
            probe = self.at(layout, (ok.rate + bad.rate) / 2)
            ok, bad = (probe, bad) if probe.meets else (ok, probe)
        return ok.rate, ok

    def predict(self, layout: Layout) -> Prediction:
        at_rate = self.at(layout, self.workload.rate) if self.workload.rate else None
        goodput, at_goodput = self.goodput(layout)
        return Prediction(layout, goodput, at_rate, at_goodput)

    def rank(self, candidates: list[Layout]) -> list[Prediction]:
        predictions = [self.predict(layout) for layout in candidates]
        return sorted(predictions, key=lambda p: (not (p.at_rate is None or p.at_rate.meets), -p.goodput,
                                                  p.layout.prefill + p.layout.decode, p.layout.describe()))


def format_ranking(ranking: list[Prediction], slo: Slo, workload: Workload, limit: int | None = None) -> str:
    terms = [t.name for t in slo.terms]
    head = f"{'#':>2}  {'layout':<24} {'goodput':>9}" + "".join(f" {t:>10}" for t in terms)
    head += "  meets" if workload.rate else ""
    lines = [f"workload {workload.describe()}; SLO {slo.describe()}",
             "goodput: the highest req/s meeting the SLO; figures " +
             (f"at {workload.rate:g} req/s" if workload.rate else "at the goodput rate"), head]
    for i, p in enumerate(ranking[:limit] if limit else ranking, 1):
        shown = p.at_rate if workload.rate else p.at_goodput
        cells = "".join(f" {shown.values[t] * 1e3:>8.1f}ms" if shown else f" {'-':>10}" for t in terms)
        meets = ("  yes" if p.at_rate.meets else "  no") if workload.rate else ""
        lines.append(f"{i:>2}  {p.layout.describe():<24} {p.goodput:>5.2f}r/s{cells}{meets}")
    return "\n".join(lines)

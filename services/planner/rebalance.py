"""Run-time rebalancing: from the router's own metrics, whether a worker should move from one role to the other.

Each window (the interval between two scrapes) gives the arrival rate, the mean prompt and output lengths, the
requests waiting on each role's workers and the TTFT and ITL quantiles the SLO names, from the router's histograms'
increase over the window (Prometheus' histogram_quantile). Against the SLO they are pressures: TTFT's figure over
its limit is prefill's pressure, ITL's over its limit is decode's. A window *wants* a worker for a role whose
pressure is over 1 and `ratio` times the other's; a move is made once `windows` windows in a row want the same one,
no move was made within `cooldown_s`, and the role that gives the worker keeps its minimum. A window with no
requests wants nothing and breaks the streak. Every window's figures and what was decided are logged.
"""
from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from services.planner.workload import Slo

TTFT = "disagg_time_to_first_token_seconds"
ITL = "disagg_inter_token_latency_seconds"
REQUESTS = "disagg_requests_total"
PROMPT_TOKENS = "disagg_prompt_tokens_total"
OUTPUT_TOKENS = "disagg_generation_tokens_total"
WAITING = "disagg_requests_waiting"


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """One scrape, every sample keyed `name{label="value",...}` (labels sorted, model and role left out)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse(response.read().decode())


def parse(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model", "role")}
            key = sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
                                 if labels else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def _buckets(samples: dict[str, float], name: str) -> list[tuple[float, float]]:
    found = []
    for key, value in samples.items():
        if key.startswith(f"{name}_bucket{{") and 'le="' in key:
            le = key.split('le="', 1)[1].split('"', 1)[0]
            found.append((math.inf if le == "+Inf" else float(le), value))
    return sorted(found)


def histogram_quantile(q: float, before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    """The q-quantile (0..1) of what histogram `name` observed between two scrapes, interpolated linearly within
    its bucket as Prometheus does; None when it observed nothing."""
    old = dict(_buckets(before, name))
    increase = [(le, count - old.get(le, 0.0)) for le, count in _buckets(after, name)]
    if not increase or increase[-1][1] <= 0:
        return None
    rank, lower, below = q * increase[-1][1], 0.0, 0.0
    for le, count in increase:
        if count >= rank:
            if math.isinf(le):
                return lower  # past the last finite bucket: its bound is all that is known
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, count
    return lower


@dataclass(frozen=True)
class Window:
    """The router's figures over one interval, and the requests waiting on each role's workers at its end."""

    seconds: float
    requests: float  # finished in the window
    prompt_tokens: float
    output_tokens: float
    quantiles: dict[str, float | None]  # each SLO term's figure, seconds (None: nothing observed)
    waiting: dict[str, float] = field(default_factory=dict)  # role -> requests waiting on its workers

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    def describe(self) -> str:
        if not self.requests:
            return f"{self.seconds:.0f}s: no requests"
        figures = ", ".join(f"{name} {v * 1e3:.0f} ms" if v is not None else f"{name} -"
                            for name, v in self.quantiles.items())
        waiting = ", ".join(f"{role} {n:.0f}" for role, n in sorted(self.waiting.items()))
        return (f"{self.seconds:.0f}s: {self.rate:.2f} req/s, prompt {self.prompt_tokens / self.requests:.0f} / output "
                f"{self.output_tokens / self.requests:.0f} tokens a request, {figures}; waiting: {waiting or '-'}")


def window(before: dict[str, float], after: dict[str, float], seconds: float, slo: Slo,
           waiting: dict[str, float] | None = None) -> Window:
    """The window between two scrapes of the router (several routers' scrapes summed first)."""
    def inc(key: str) -> float:
        return sum(v for k, v in after.items() if k.split("{")[0] == key) - sum(
            v for k, v in before.items() if k.split("{")[0] == key)

    quantiles = {t.name: histogram_quantile(t.quantile / 100, before, after,
                                            {"ttft": TTFT, "itl": ITL}.get(t.metric, "disagg_e2e_request_latency_seconds"))
                 for t in slo.terms}
    return Window(seconds, inc(REQUESTS), inc(PROMPT_TOKENS), inc(OUTPUT_TOKENS), quantiles, dict(waiting or {}))


@dataclass(frozen=True)
class Move:
    source: str  # the role that gives a worker
    target: str
    why: str


@dataclass
class Rebalancer:
    slo: Slo
    minimum: dict[str, int]  # role -> workers it keeps at least
    windows: int = 3  # windows in a row that must want the same move
    cooldown_s: float = 60.0  # no move within this long of the last one
    ratio: float = 1.5  # the pressed role's pressure must be this many times the other's
    streak: int = 0
    wanted: str | None = None
    last_move_at: float = -math.inf

    def pressures(self, w: Window) -> dict[str, float]:
        """prefill: the SLO's TTFT term's figure over its limit; decode: its ITL term's (the worst of each)."""
        out = {"prefill": 0.0, "decode": 0.0}
        for term in self.slo.terms:
            role = {"ttft": "prefill", "itl": "decode"}.get(term.metric)
            figure = w.quantiles.get(term.name)
            if role and figure is not None:
                out[role] = max(out[role], figure / term.limit_s)
        return out

    def observe(self, w: Window, counts: dict[str, int], now: float) -> tuple[Move | None, str]:
        """What window `w` decides, given each role's worker count now: a move or None, and the log line."""
        if not w.requests:
            self.streak, self.wanted = 0, None
            return None, f"planner: window {w.describe()}: hold (no traffic)"
        p = self.pressures(w)
        pressure = f"pressure prefill {p['prefill']:.2f}x, decode {p['decode']:.2f}x of the SLO"
        want = next((role for role, other in (("prefill", "decode"), ("decode", "prefill"))
                     if p[role] > 1 and p[role] > self.ratio * p[other]), None)
        self.streak = self.streak + 1 if want is not None and want == self.wanted else (1 if want else 0)
        self.wanted = want
        line = f"planner: window {w.describe()}; {pressure}"
        if want is None:
            return None, f"{line}: hold (neither role over its SLO by {self.ratio:g}x the other)"
        source = "decode" if want == "prefill" else "prefill"
        if counts.get(source, 0) - 1 < self.minimum.get(source, 0):
            return None, f"{line}: hold ({want} wants a worker, but {source} keeps its minimum of " \
                         f"{self.minimum.get(source, 0)})"
        if self.streak < self.windows:
            return None, f"{line}: hold ({want} wants a worker: {self.streak} of {self.windows} windows)"
        if now - self.last_move_at < self.cooldown_s:
            return None, f"{line}: hold ({want} wants a worker, cooling down {self.cooldown_s:.0f}s after a move)"
        self.streak, self.wanted, self.last_move_at = 0, None, now
        why = f"{pressure}, {self.windows} windows in a row"
        return Move(source, want, why), f"{line}: move a {source} worker to {want}"

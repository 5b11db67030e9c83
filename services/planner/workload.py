"""What the planner plans for: a workload (prompt and output length distributions, an arrival rate) and an SLO
(latency quantiles with their limits).

    --workload "in=512-2048,out=128,rate=8"      uniform prompts of 512..2048 tokens, 128 out, 8 req/s (Poisson)
    --workload "in=normal:1024:256,out=512"     any `disagg bench` length form; no rate: rank by goodput alone
    --workload workload.json                    {"in": "512-2048", "out": 128, "rate": 8}
    --slo ttft_p90=250ms,itl_p99=15ms           TTFT's p90 within 250 ms and ITL's p99 within 15 ms (s, ms, us)
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from common.errors import InvalidConfig
from services.cli.bench.workload import LengthDist

METRICS = ("ttft", "itl", "e2e")  # what an SLO term may bound: time to first token, inter-token gaps, whole request
_TERM = re.compile(r"^(ttft|itl|e2e)_p(\d{1,2}(?:\.\d+)?)$")
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Workload:
    prompt: LengthDist
    output: LengthDist
    rate: float | None = None  # requests/s of a Poisson process; None: not given (rank by goodput alone)

    def to_dict(self) -> dict:
        return {"in": str(self.prompt), "out": str(self.output), "rate": self.rate}

    def describe(self) -> str:
        rate = f", {self.rate:g} req/s" if self.rate else ""
        return f"in {self.prompt}, out {self.output}{rate}"


@dataclass(frozen=True)
class SloTerm:
    metric: str  # ttft | itl | e2e
    quantile: float  # in (0, 100)
    limit_s: float

    @property
    def name(self) -> str:
        return f"{self.metric}_p{self.quantile:g}"


@dataclass(frozen=True)
class Slo:
    terms: tuple[SloTerm, ...]

    def describe(self) -> str:
        return ",".join(f"{t.name}={t.limit_s * 1e3:g}ms" for t in self.terms)

    def to_text(self) -> str:
        return self.describe()


def _length(text: str, key: str) -> LengthDist:
    """`512-2048` (uniform), `128` (fixed), or a bench form (`uniform:512:2048`, `normal:1024:256`)."""
    text = str(text).strip()
    low, dash, high = text.partition("-")
    form = f"uniform:{low}:{high}" if dash and low.isdigit() and high.isdigit() else text
    try:
        return LengthDist.parse(form)
    except ValueError as exc:
        raise InvalidConfig(f"--workload {key}=: {exc}") from None


def parse_workload(text: str) -> Workload:
    """`in=...,out=...[,rate=R]`, or a JSON file of those keys."""
    path = Path(text)
    if text.endswith(".json") or path.is_file():
        try:
            fields = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidConfig(f"--workload {text}: {exc}") from None
    else:
        fields = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = part.partition("=")
            if not eq:
                raise InvalidConfig(f"--workload: expected key=value, got {part!r} (keys: in, out, rate)")
            fields[key.strip()] = value.strip()
    unknown = set(fields) - {"in", "out", "rate"}
    if unknown or "in" not in fields or "out" not in fields:
        raise InvalidConfig(f"--workload needs in= and out= (and may give rate=); got keys {sorted(fields)}")
    rate = fields.get("rate")
    try:
        rate = None if rate in (None, "") else float(rate)
    except ValueError:
        raise InvalidConfig(f"--workload rate= takes requests/s, got {rate!r}") from None
    if rate is not None and rate <= 0:
        raise InvalidConfig(f"--workload rate= must be > 0, got {rate:g}")
    return Workload(_length(fields["in"], "in"), _length(fields["out"], "out"), rate)


def parse_slo(text: str) -> Slo:
    """`ttft_p90=250ms,itl_p99=15ms`: each term a metric's quantile and its limit."""
    terms = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        match = _TERM.match(key.strip())
        limit = re.match(r"^([0-9]*\.?[0-9]+)\s*(us|ms|s)$", value.strip())
        if not eq or not match or not limit:
            raise InvalidConfig(f"--slo: expected METRIC_pQ=LIMIT such as ttft_p90=250ms (metrics: "
                                f"{', '.join(METRICS)}; units: us, ms, s), got {part!r}")
        quantile = float(match.group(2))
        if not 0 < quantile < 100:
            raise InvalidConfig(f"--slo {key}: the quantile must be in (0, 100)")
        terms.append(SloTerm(match.group(1), quantile, float(limit.group(1)) * _UNITS[limit.group(2)]))
    if not terms:
        raise InvalidConfig("--slo needs at least one term, such as ttft_p90=250ms,itl_p99=15ms")
    return Slo(tuple(terms))

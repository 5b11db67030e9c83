"""Per-request timings and the summary `disagg bench` reports (vLLM `bench serve` definitions).

TTFT: send → first token. ITL: the gap between successive token arrivals (a delta of k tokens
counts as one gap). TPOT: (e2e − TTFT) / (output tokens − 1), a request's mean time per
output token. Goodput: completed requests per second whose TTFT and TPOT are within the limits.

The TTFT breakdown is the router's (disagg.v1 Finished.usage.ttft_breakdown, or the OpenAI usage chunk's
`ttft_breakdown`; KServe carries no usage): each part over the requests it applies to, and `other`, the client's
TTFT less the three parts on the first token's path (router queue, prefill queue, prefill compute): the network and
gRPC both ways, and the prefill worker's answer after its first token. Where the router reports its own TTFT
(Usage.ttft_ms), `other` splits in two: `router_worker_ms`, inside the router's TTFT (the prompt's call to the worker
and its answer back: the worker's path from its engine's first token to its answer, gRPC, the router's handling), and
`client_router_ms`, outside it (the client's call reaching the router's handler, the first token relayed back: a busy
router's event loop, the network, the client). KV handoff and the first decode step come after the first token
(prefill → decode only): they are what the second token waits for.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
FIRST_TOKEN_PARTS = ("router_queue_ms", "prefill_queue_ms", "prefill_compute_ms")
AFTER_FIRST_TOKEN_PARTS = ("kv_handoff_ms", "first_decode_step_ms")
# A sending event loop this busy (of a core) timed its tokens late: its own queue sits in every TTFT and gap it took.
CLIENT_LOOP_SATURATED = 0.85


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int
    max_tokens: int
    start: float = 0.0  # time.perf_counter() at send
    token_times: list[float] = field(default_factory=list)  # arrival of each delta that carried tokens
    output_tokens: int = 0
    end: float = 0.0
    error: str | None = None
    ttft_breakdown: dict[str, float] | None = None  # ms by TtftBreakdown field, as the router reported them
    router_ttft_ms: float | None = None  # the router's own TTFT (Usage.ttft_ms): its arrival → its first delta

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens > 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class Distribution:
    """Milliseconds."""

    mean: float
    std: float
    p50: float
    p90: float
    p99: float
    max: float
    count: int

    @classmethod
    def of(cls, seconds: list[float]) -> "Distribution":
        if not seconds:
            return cls(*([float("nan")] * 6), count=0)
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(ms, PERCENTILES)
        return cls(float(ms.mean()), float(ms.std()), float(p50), float(p90), float(p99), float(ms.max()), len(ms))


@dataclass
class SloLimits:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if self.ttft_ms is not None and record.ttft * 1000 > self.ttft_ms:
            return False
        tpot = record.tpot
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


@dataclass
class Summary:
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    goodput: float | None  # requests / s within the SLO limits; None when no limit was given
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    errors: list[str]
    ttft_breakdown: dict[str, Distribution] | None = None  # by part, and "other_ms"; None: the API reports none
    # each sending event loop's busy share (CPU / wall of its thread; one a --clients process): CLIENT_LOOP_SATURATED
    # or more, that client's loop delayed the tokens it timed
    client_loop_busy: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: list[RequestRecord], duration_s: float, slo: SloLimits,
              client_loop_busy: list[float] | None = None) -> Summary:
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    has_slo = slo.ttft_ms is not None or slo.tpot_ms is not None
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return Summary(
        completed=len(done), failed=len(failed), duration_s=duration_s,
        input_tokens=input_tokens, output_tokens=output_tokens,
        request_throughput=rate(len(done)), output_throughput=rate(output_tokens),
        total_token_throughput=rate(input_tokens + output_tokens),
        goodput=rate(sum(slo.met_by(r) for r in done)) if has_slo else None,
        ttft=Distribution.of([r.ttft for r in done]),
        tpot=Distribution.of([t for r in done if (t := r.tpot) is not None]),
        itl=Distribution.of([gap for r in done for gap in r.itls]),
        e2e=Distribution.of([r.e2e for r in done]),
        errors=sorted({r.error or "no tokens returned" for r in failed}),
        ttft_breakdown=summarize_breakdown(done),
        client_loop_busy=list(client_loop_busy or []),
    )


def summarize_breakdown(done: list[RequestRecord]) -> dict[str, Distribution] | None:
    """Each part of the TTFT breakdown over the completed requests it applies to, and `other_ms`."""
    reported = [r for r in done if r.ttft_breakdown]
    if not reported:
        return None
    parts = {part: Distribution.of([r.ttft_breakdown[part] / 1000 for r in reported if part in r.ttft_breakdown])
             for part in FIRST_TOKEN_PARTS + AFTER_FIRST_TOKEN_PARTS}
    parts["other_ms"] = Distribution.of([r.ttft - _first_token_path_ms(r) / 1000 for r in reported])
    timed = [r for r in reported if r.router_ttft_ms]
    if timed:
        parts["router_worker_ms"] = Distribution.of([(r.router_ttft_ms - _first_token_path_ms(r)) / 1000
                                                     for r in timed])
        parts["client_router_ms"] = Distribution.of([r.ttft - r.router_ttft_ms / 1000 for r in timed])
    return parts


def _first_token_path_ms(record: RequestRecord) -> float:
    """The router's parts on the first token's path (FIRST_TOKEN_PARTS), summed."""
    return sum(record.ttft_breakdown.get(part, 0.0) for part in FIRST_TOKEN_PARTS)

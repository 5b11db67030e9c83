"""A discrete-event simulation of one layout serving a workload, over a profile's step costs. Deterministic: the
requests (arrival times, lengths) come from a seed, and the simulated engines schedule as ours do.

What it models:
- the router: a prompt whose length is at most the layout's local-prefill threshold (or every prompt, with no
  prefill worker) prefills on the decode worker it is placed on; longer ones on the prefill worker with the fewest
  queued tokens; each request goes to the decode worker with the fewest requests (running and waiting).
- a prefill worker: steps of prompt chunks, first come first served, within the step budget and a prompt's chunk
  limit; a prompt's first token comes at the end of its last chunk's step, then its KV is handed off (the
  profile's handoff cost) and it waits for the decode worker's next step.
- a decode worker: continuous batching up to max_num_seqs rows; each step gives every row a token and, with local
  prompts waiting, carries their chunks in what the budget leaves (a mixed step).
What it leaves out: KV capacity (preemption), prefix-cache hits, the router's and the network's own time, and
conditional routing on queue depth (--max-prefill-queue-tokens). docs/planner.md says how far it is off.
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from services.planner.profile import StepCosts, chunks
from services.planner.workload import Workload


@dataclass
class SimRequest:
    index: int
    arrival: float
    prompt: int
    output: int
    first_token: float | None = None
    last_token: float | None = None
    remaining: int = 0  # prompt tokens still to compute
    computed: int = 0
    gaps: list[float] = field(default_factory=list)  # its first decode gap (the handoff's wait is in it)
    decode: object = None  # the _Decode it is placed on


def make_requests(workload: Workload, count: int, rate: float, seed: int) -> list[SimRequest]:
    """`count` requests of the workload at `rate` req/s. The gaps are drawn at rate 1 and scaled, so every rate and
    every layout sees the same requests in the same order (common random numbers: comparisons are not noise)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(count):
        t += rng.expovariate(1.0)
        out.append(SimRequest(i, t / rate, workload.prompt.sample(rng), workload.output.sample(rng)))
    return out


class _Prefill:
    def __init__(self, costs: StepCosts):
        self.costs = costs
        self.queue: deque[SimRequest] = deque()
        self.busy = False

    @property
    def queued_tokens(self) -> int:
        return sum(r.remaining for r in self.queue)


class _Decode:
    def __init__(self, costs: StepCosts):
        self.costs = costs
        self.local: deque[SimRequest] = deque()  # prompts to prefill here
        self.joining: deque[SimRequest] = deque()  # first token out, waiting for a row
        self.rows = 0
        self.steps = 0  # decode steps run so far
        self.finishing: list[tuple[int, int, SimRequest]] = []  # (the step it makes its last token in, index, row)
        self.context_sum = 0
        self.fresh: list[SimRequest] = []  # rows in their first decode step
        self.busy = False

    @property
    def load(self) -> int:
        return self.rows + len(self.joining) + len(self.local)


@dataclass
class SimResult:
    requests: list[SimRequest]
    step_gaps: list[tuple[float, int]]  # (a decode step's duration, rows past their first decode step in it)
    duration_s: float

    def ttft(self) -> np.ndarray:
        return np.array([r.first_token - r.arrival for r in self.requests])

    def e2e(self) -> np.ndarray:
        return np.array([r.last_token - r.arrival for r in self.requests])

    def backlog_growth(self) -> float:
        """Mean end-to-end latency of the last quarter of requests (by arrival) over that of the second quarter:
        about 1 while the layout keeps up with the rate; an overloaded layout's queue grows with every arrival, and
        so does this (latency quantiles over a finite run can hide it: a request's wait for a decode slot is one
        inter-token gap among hundreds)."""
        e2e = self.e2e()
        quarter = max(1, len(e2e) // 4)
        second = float(np.mean(e2e[quarter:2 * quarter])) if len(e2e) >= 2 * quarter else float(np.mean(e2e))
        return float(np.mean(e2e[-quarter:])) / second if second > 0 else 1.0

    def itl_quantile(self, q: float) -> float:
        """The q-th percentile of every inter-token gap (as `disagg bench` counts ITL: each gap of each request)."""
        durations = [d for d, n in self.step_gaps if n] + [g for r in self.requests for g in r.gaps]
        weights = [n for _, n in self.step_gaps if n] + [1] * sum(len(r.gaps) for r in self.requests)
        if not durations:
            return 0.0
        order = np.argsort(durations)
        cum = np.cumsum(np.asarray(weights, dtype=float)[order])
        at = np.searchsorted(cum, q / 100.0 * cum[-1])
        return float(np.asarray(durations)[order][min(at, len(order) - 1)])


class Simulation:
    def __init__(self, prefill: list[StepCosts], decode: list[StepCosts], max_local_prefill_tokens: int):
        self.prefill = [_Prefill(c) for c in prefill]
        self.decode = [_Decode(c) for c in decode]
        self.threshold = max_local_prefill_tokens
        self.events: list = []
        self.order = itertools.count()
        self.step_gaps: list[tuple[float, int]] = []

    def run(self, requests: list[SimRequest]) -> SimResult:
        for r in requests:
            r.remaining, r.computed = r.prompt, 0
            self._at(r.arrival, self._arrive, r)
        now = 0.0
        while self.events:
            now, _, call, arg = heapq.heappop(self.events)
            call(now, arg)
        return SimResult(requests, self.step_gaps, now)

    def _at(self, t: float, call, arg) -> None:
        heapq.heappush(self.events, (t, next(self.order), call, arg))

    def _arrive(self, now: float, r: SimRequest) -> None:
        decode = min(self.decode, key=lambda d: d.load)
        r.decode = decode
        if not self.prefill or r.prompt <= self.threshold:
            decode.local.append(r)
            self._kick_decode(now, decode)
            return
        worker = min(self.prefill, key=lambda p: p.queued_tokens)
        worker.queue.append(r)
        self._kick_prefill(now, worker)

    def _kick_prefill(self, now: float, p: _Prefill) -> None:
        if p.busy or not p.queue:
            return
        limits = p.costs.limits
        queue = list(p.queue)
        step = chunks([r.remaining for r in queue], [r.computed for r in queue], limits.step_tokens,
                      limits.chunk_tokens)
        advanced = queue[:len(step)]
        for r, (n, _) in zip(advanced, step):
            r.remaining -= n
            r.computed += n
        p.busy = True
        self._at(now + p.costs.prefill_step(step), self._prefill_done, (p, advanced))

    def _prefill_done(self, now: float, arg) -> None:
        p, advanced = arg
        p.busy = False
        for r in advanced:
            if r.remaining == 0:
                p.queue.remove(r)
                r.first_token = r.last_token = now
                if r.output > 1:
                    self._at(now + p.costs.handoff(r.prompt), self._handed_off, r)
        self._kick_prefill(now, p)

    def _handed_off(self, now: float, r: SimRequest) -> None:
        r.decode.joining.append(r)
        self._kick_decode(now, r.decode)

    def _kick_decode(self, now: float, d: _Decode) -> None:
        if d.busy:
            return
        limits = d.costs.limits
        while d.joining and d.rows < limits.max_num_seqs:
            r = d.joining.popleft()
            d.rows += 1
            heapq.heappush(d.finishing, (d.steps + r.output - 1, r.index, r))
            d.context_sum += r.prompt + 1
            d.fresh.append(r)
        local = list(d.local)[:max(limits.max_num_seqs - d.rows, 0)]
        step = chunks([r.remaining for r in local], [r.computed for r in local], limits.step_tokens - d.rows,
                      limits.chunk_tokens)
        if not d.rows and not step:
            return
        advanced = local[:len(step)]
        for r, (n, _) in zip(advanced, step):
            r.remaining -= n
            r.computed += n
        d.busy = True
        duration = d.costs.mixed_step(d.rows, d.context_sum, step)
        self._at(now + duration, self._decode_done, (d, advanced, duration))

    def _decode_done(self, now: float, arg) -> None:
        d, advanced, duration = arg
        d.busy = False
        if d.rows:
            d.steps += 1
            self.step_gaps.append((duration, d.rows - len(d.fresh)))
        for r in d.fresh:
            r.gaps.append(now - r.last_token)
        d.fresh.clear()
        d.context_sum += d.rows
        while d.finishing and d.finishing[0][0] <= d.steps:
            _, _, r = heapq.heappop(d.finishing)
            r.last_token = now
            d.rows -= 1
            d.context_sum -= r.prompt + r.output
        for r in advanced:
            if r.remaining == 0:
                d.local.remove(r)
                r.first_token = r.last_token = now
                if r.output > 1:
                    d.joining.append(r)
        self._kick_decode(now, d)


def simulate(prefill: list[StepCosts], decode: list[StepCosts], max_local_prefill_tokens: int,
             requests: list[SimRequest]) -> SimResult:
    """Every request of `requests` through the layout; the requests are copied, so a list may be reused."""
    fresh = [SimRequest(r.index, r.arrival, r.prompt, r.output) for r in requests]
    return Simulation(prefill, decode, max_local_prefill_tokens).run(fresh)

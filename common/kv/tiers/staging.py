"""The prefetches that wait for their requests' admission, and the requests whose tier hits did not pay.

A request's prefetch is queued as the request is (KvTiers.prefetch); admission asks `ready` and passes the request
over while its blocks still load, for as long as computing them would take (OnboardPayoff.wait_bound_s, from when it
could first have been admitted); then `take` hands over what was staged, with how long admission held the request
for it, or says to compute: its hit did not pay when it was queued, or its prefetch ran past the bound (the wait and
the computing that follows it then count as the tier's onboarding cost: twice computing, at the bound). Engine
thread, but for a prefetch's end (the load thread).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from common.kv.tiers.payoff import OnboardPayoff
from common.kv.tiers.record import BlockKey, StoredBlock

log = logging.getLogger(__name__)

@dataclass
class Prefetch:
    future: Future
    keys: list[BlockKey]
    tiers: list[str]  # the tier each key was in when the prefetch was queued
    deferred_at: float | None = None  # when admission first passed the request over for it (monotonic)
    bound_s: float = 0.0  # how long admission may hold it from then
    done_at: float | None = None


@dataclass
class Staged:
    """What admission takes for a request: `compute` (its tier blocks are computed), else the blocks a prefetch
    staged (None: no prefetch ran for it), the hash of the last block it was asked for (those after it did not pay:
    they are computed) and the seconds admission held the request for them."""

    compute: bool = False
    blocks: dict[int, StoredBlock] | None = None
    last: int | None = None
    held_s: float = 0.0


class Prefetches:
    MAX = 64  # requests remembered (an aborted one's are dropped)

    def __init__(self, payoff: OnboardPayoff):
        self.payoff = payoff
        self.staged: OrderedDict[str, Prefetch] = OrderedDict()  # request id -> its prefetch
        self.skipped: OrderedDict[str, None] = OrderedDict()  # requests whose hits did not pay when queued

    def add(self, request_id: str, future: Future, keys: list[BlockKey], tiers: list[str],
            on_loaded: Callable[[], None] | None) -> None:
        prefetch = Prefetch(future, keys, tiers)

        def loaded(_):
            prefetch.done_at = time.monotonic()
            if on_loaded is not None:
                on_loaded()

        future.add_done_callback(loaded)
        self.staged[request_id] = prefetch
        _bound(self.staged, self.MAX)

    def skip(self, request_id: str) -> None:
        self.skipped[request_id] = None
        _bound(self.skipped, self.MAX)

    def ready(self, request_id: str, cap_s: float) -> bool:
        """No prefetch of the request runs, or it ended, or admission has held the request as long as computing its
        blocks would take (at most `cap_s`)."""
        prefetch = self.staged.get(request_id)
        if prefetch is None or prefetch.future.done():
            return True
        now = time.monotonic()
        if prefetch.deferred_at is None:
            prefetch.deferred_at = now
            prefetch.bound_s = self.payoff.wait_bound_s(len(prefetch.keys), cap_s)
        return now - prefetch.deferred_at >= prefetch.bound_s

    def wait_left_s(self) -> float | None:
        """Seconds until the first request held for its prefetch may be admitted anyway (None: none is held)."""
        now = time.monotonic()
        left = [p.deferred_at + p.bound_s - now for p in self.staged.values()
                if p.deferred_at is not None and not p.future.done()]
        return max(0.0, min(left)) if left else None

    def take(self, request_id: str) -> Staged:
        """At admission: what the request's prefetch staged, or that it computes; a late prefetch's wait is counted
        against its tiers."""
        if request_id in self.skipped:
            del self.skipped[request_id]
            return Staged(compute=True)
        prefetch = self.staged.pop(request_id, None)
        if prefetch is None:
            return Staged()
        if not prefetch.future.done():  # it cost the request its wait and then the computing it was to save
            waited = time.monotonic() - (prefetch.deferred_at or time.monotonic())
            cost = waited + len(prefetch.keys) * (self.payoff.compute_s_per_block or 0.0)
            for tier in set(prefetch.tiers):
                share = prefetch.tiers.count(tier)
                self.payoff.onboarded(tier, share, cost * share / len(prefetch.tiers))
            log.info("KV tiers: the prefetch of %s took over %.3f s, as long as its prefill; computing it",
                     request_id, waited)
            return Staged(compute=True)
        try:
            blocks = prefetch.future.result()
        except Exception:
            log.exception("KV tiers: the prefetch of %s failed; loading here", request_id)
            blocks = {}
        held = 0.0
        if prefetch.deferred_at is not None and prefetch.done_at is not None:
            held = max(0.0, prefetch.done_at - prefetch.deferred_at)
        return Staged(blocks=blocks, last=prefetch.keys[-1].hash, held_s=held)


def _bound(entries: OrderedDict, most: int) -> None:
    while len(entries) > most:
        entries.popitem(last=False)

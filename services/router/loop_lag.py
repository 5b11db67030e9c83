"""Beside the request path: how late the router's event loop runs, while requests are in flight:
disagg_event_loop_lag_seconds.

One event loop relays every token of every request (per token ~100 µs of this loop on the development machine), so
when it is busy everything waits: a new request's handler before it starts (no part of the TTFT breakdown sees
that), each token before it is written. The probe sleeps `interval_s` and observes how much later than that it
woke. It runs only while a request is in flight and stops with the last one: an idle router does not wake for it.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Callable

INTERVAL_S = 0.05


class LoopLagProbe:
    def __init__(self, observe: Callable[[float], None], in_flight: Callable[[], bool],
                 interval_s: float = INTERVAL_S):
        self._observe = observe
        self._in_flight = in_flight  # the router's own count: the probe runs while it says so
        self._interval_s = interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """A request came in: probe from now until none is in flight (one probe for all of them)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag-probe")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._in_flight():
            start = loop.time()
            await asyncio.sleep(self._interval_s)
            self._observe(max(loop.time() - start - self._interval_s, 0.0))

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

"""A worker's graceful drain: what it admits, what it has in flight, and the wait until it is idle.

On SIGTERM / SIGINT the worker turns NOT_SERVING (the router, which watches its health, stops picking it at
once) and closes its `Admission`: a new Prefill / Decode / Encode gets UNAVAILABLE naming the drain, so the
router places it on another worker, while requests in flight run on. `until_idle` waits until none is left and
the worker holds nothing that another worker has still to pull (exported KV sessions, stored embeddings: its
TensorStore keeps serving meanwhile), up to --drain-timeout; past it the shell ends what is left.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Awaitable, Callable, Iterator

from common.errors import Unavailable

DEFAULT_DRAIN_TIMEOUT_S = 30.0
_IDLE_POLL_S = 0.05  # sessions end in other processes' Release calls or by TTL: nothing here to await


class Admission:
    """Open until the drain starts; counts the requests in flight and, once closed, the ones it refused."""

    def __init__(self) -> None:
        self.inflight = 0
        self.refusal: str | None = None  # why a new request is refused, once the drain started
        self.closed_at = 0.0  # time.monotonic() when it closed
        self.refused = 0
        self.last_refused_after_s = 0.0  # how long after the close the last refused request came

    def close(self, refusal: str) -> None:
        if self.refusal is None:
            self.refusal, self.closed_at = refusal, time.monotonic()

    def check(self) -> None:
        """Unavailable (naming the drain) for a new request once the drain has started."""
        if self.refusal is not None:
            self.refused += 1
            self.last_refused_after_s = time.monotonic() - self.closed_at
            raise Unavailable(self.refusal)

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """Count one request for as long as its RPC runs (refused ones leave at once)."""
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    def summary(self) -> str:
        if not self.refused:
            return "no new request came after NOT_SERVING"
        return (f"{self.refused} new requests refused after NOT_SERVING, the last "
                f"{self.last_refused_after_s:.2f}s after it")


async def until_idle(admission: Admission, timeout_s: float, held: Callable[[], Awaitable[int]] | None = None) -> bool:
    """Until no request is in flight and `held()` (what others still have to pull) is 0; False past `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while admission.inflight or (held is not None and await held()):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(min(_IDLE_POLL_S, max(0.0, deadline - loop.time())))
    return True

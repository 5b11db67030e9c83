"""The tiers' own thread: it stores blocks evicted from the device down and loads a new request's blocks up, off the
engine thread. A load is some request's next step waiting, so loads go before stores; stores wait in a queue bounded
in bytes, past which an eviction is dropped (counted) rather than held: the bandwidth down is what one thread writes.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Mover:
    MAX_PENDING_BYTES = 256 << 20

    def __init__(self, max_pending_bytes: int = MAX_PENDING_BYTES):
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self._loads: deque[tuple[Callable, Future]] = deque()
        self._stores: deque[tuple[Callable, int]] = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-tiers", daemon=True)
        self._thread.start()

    def has_room(self, nbytes: int) -> bool:
        return self.pending_bytes + nbytes <= self.max_pending_bytes

    def store(self, job: Callable[[], None], nbytes: int) -> bool:
        """Queue a store of `nbytes`; False (not queued) when the queue is full or closed."""
        with self._cv:
            if self._closed or not self.has_room(nbytes):
                return False
            self.pending_bytes += nbytes
            self._stores.append((job, nbytes))
            self._cv.notify()
        return True

    def load(self, job: Callable[[], T]) -> Future:
        future: Future = Future()
        with self._cv:
            if self._closed:
                future.set_result({})
                return future
            self._loads.append((job, future))
            self._cv.notify()
        return future

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued job has run (tests, shutdown); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not (self._loads or self._stores or self._busy), timeout_s)

    def close(self) -> None:
        self.drain()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._loads or self._stores or self._closed)
                if self._closed and not (self._loads or self._stores):
                    return
                load = self._loads.popleft() if self._loads else None
                store = None if load is not None else self._stores.popleft()
                self._busy = True
            try:
                if load is not None:
                    job, future = load
                    try:
                        future.set_result(job())
                    except BaseException as exc:  # the fetch that waits on it loads on its own thread instead
                        future.set_exception(exc)
                else:
                    try:
                        store[0]()
                    except Exception:  # a store that failed loses one copy of a block, nothing more
                        log.exception("a KV tier store failed")
            finally:
                with self._cv:
                    if store is not None:
                        self.pending_bytes -= store[1]
                    self._busy = False
                    self._cv.notify_all()

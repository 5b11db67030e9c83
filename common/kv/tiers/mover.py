"""The tiers' own threads: one loads a new request's blocks up, one stores blocks evicted from the device down, both
off the engine thread. A load is some request's next step waiting, so loads never queue behind a store: each has its
thread (the copies and checksums they spend their time in release the GIL). Stores run one at a time, in order, in a
queue bounded in bytes, past which an eviction is dropped (counted) rather than held: the bandwidth down is what one
thread writes.
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
        self._busy = 0  # jobs taken off a queue and still running
        self._closed = False
        self._threads = [threading.Thread(target=self._run, args=(self._loads, self._load), name="kv-tiers",
                                          daemon=True),
                         threading.Thread(target=self._run, args=(self._stores, self._store), name="kv-tiers-store",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    def has_room(self, nbytes: int) -> bool:
        return self.pending_bytes + nbytes <= self.max_pending_bytes

    def store(self, job: Callable[[], None], nbytes: int) -> bool:
        """Queue a store of `nbytes`; False (not queued) when the queue is full or closed."""
        with self._cv:
            if self._closed or not self.has_room(nbytes):
                return False
            self.pending_bytes += nbytes
            self._stores.append((job, nbytes))
            self._cv.notify_all()
        return True

    def load(self, job: Callable[[], T]) -> Future:
        future: Future = Future()
        with self._cv:
            if self._closed:
                future.set_result({})
                return future
            self._loads.append((job, future))
            self._cv.notify_all()
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
        for thread in self._threads:
            thread.join(timeout=5)

    def _run(self, jobs: deque, run: Callable[[tuple], None]) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: jobs or self._closed)
                if self._closed and not jobs:
                    return
                item = jobs.popleft()
                self._busy += 1
            try:
                run(item)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    @staticmethod
    def _load(item: tuple[Callable, Future]) -> None:
        job, future = item
        try:
            future.set_result(job())
        except BaseException as exc:  # the fetch that waits on it loads on its own thread instead
            future.set_exception(exc)

    def _store(self, item: tuple[Callable, int]) -> None:
        job, nbytes = item
        try:
            job()
        except Exception:  # a store that failed loses one copy of a block, nothing more
            log.exception("a KV tier store failed")
        finally:
            with self._cv:
                self.pending_bytes -= nbytes

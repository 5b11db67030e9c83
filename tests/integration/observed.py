"""Helpers for the observability tests: a service's metrics endpoint and one scrape of it."""
from __future__ import annotations

import time
from typing import Callable

from benchmarks.scrape import metrics_port, metrics_url, scrape  # noqa: F401 (written once, for the benches too)


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.1):
    """Poll until `condition()` is truthy; its value, or AssertionError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(every_s)

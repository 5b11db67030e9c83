"""Clients that run as threads at once: started together, joined, the first error re-raised on the caller's thread."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence


def timed_in_threads(targets: Sequence[Callable[[], None]]) -> float:
    """Runs every target in a thread of its own and waits for all; the wall seconds they took together. A target's
    exception does not stop the others; the first one raised is re-raised here once all have ended."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 (re-raised on the caller's thread)
            errors.append(exc)

    started = time.perf_counter()
    threads = [threading.Thread(target=guarded, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started

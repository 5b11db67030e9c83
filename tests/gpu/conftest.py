"""Every GPU test ends by itself: a hung one (a collective waiting for a rank that never comes, a worker that
never announces itself) fails within its limit with every thread's stack, instead of holding the machine."""
from __future__ import annotations

from pathlib import Path

import pytest

GPU_TEST_TIMEOUT_S = 300
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(item.path).resolve().parents and item.get_closest_marker("timeout") is None:
            # "thread": a watchdog thread dumps every stack and ends the run, where a signal would wait for a
            # C call (NCCL, CUDA) to return first.
            item.add_marker(pytest.mark.timeout(GPU_TEST_TIMEOUT_S, method="thread"))

"""benchmarks/threads.py: every client thread runs to its end, and a failure in one reaches the caller."""
from __future__ import annotations

import threading

import pytest

from benchmarks.threads import timed_in_threads


def test_every_target_runs_at_once_and_the_wall_time_is_returned():
    barrier = threading.Barrier(3, timeout=5)  # passes only if all three run at the same time
    ran = []
    elapsed = timed_in_threads([lambda i=i: (barrier.wait(), ran.append(i)) for i in range(3)])
    assert sorted(ran) == [0, 1, 2]
    assert elapsed >= 0


def test_a_failing_target_is_re_raised_after_the_others_finish():
    finished = []

    def fails() -> None:
        raise ValueError("client 0 failed")

    with pytest.raises(ValueError, match="client 0 failed"):
        timed_in_threads([fails, lambda: finished.append("other")])
    assert finished == ["other"]

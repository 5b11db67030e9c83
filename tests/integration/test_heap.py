"""settle_heap: the start-up heap leaves the collector's oldest generation, and every collection is timed."""
import gc
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from common.heap import _PauseTimer, settle_heap, watch_pauses
from common.telemetry.metrics import Metrics


@pytest.fixture
def restore_gc():
    callbacks = list(gc.callbacks)
    yield
    gc.unfreeze()
    gc.callbacks[:] = callbacks


def _pause_count(metrics: Metrics, generation: int) -> float:
    return metrics.registry.get_sample_value("disagg_gc_pause_seconds_count",
                                             {"model": "m", "role": "decode", "generation": str(generation)})


def test_settling_freezes_what_lives_so_the_oldest_generation_holds_only_later_objects(restore_gc):
    kept = [[i] for i in range(50_000)]  # tracked objects, like a loaded model's Python side
    gc.collect()
    assert len(gc.get_objects(generation=2)) > 50_000
    frozen = settle_heap()
    # a frozen object still dies when its last reference goes (another test's thread may drop one meanwhile): the
    # count only shrinks from what settle_heap froze
    assert frozen >= 50_000 and 50_000 <= gc.get_freeze_count() <= frozen
    # what a full collection walks now: only what was made since, not the process's start-up objects
    assert len(gc.get_objects(generation=2)) < 1_000
    assert kept[-1] == [49_999]


def test_every_collection_is_timed_by_generation_with_one_timer_a_process(restore_gc):
    first, metrics = Metrics.create("decode", "m"), Metrics.create("decode", "m")
    watch_pauses(first)
    settle_heap(metrics)  # replaces the first registry's timer
    assert sum(isinstance(cb, _PauseTimer) for cb in gc.callbacks) == 1
    before, first_before = [_pause_count(metrics, g) for g in range(3)], _pause_count(first, 2)
    gc.collect(0)
    gc.collect(2)
    assert _pause_count(metrics, 0) >= before[0] + 1 and _pause_count(metrics, 2) == before[2] + 1
    assert _pause_count(first, 2) == first_before
    assert metrics.registry.get_sample_value("disagg_gc_pause_seconds_sum", {
        "model": "m", "role": "decode", "generation": "2"}) > 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_process_that_settled_its_heap_exits_without_leak_reports():
    """Frozen objects are skipped by the interpreter's last collections: triton's bindings (nanobind) would report
    every object of theirs still alive at exit as a leak, on every worker's stderr, unless they are unfrozen first."""
    script = "import triton, triton.language\nfrom common.heap import settle_heap\nsettle_heap()\n"
    result = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]

"""settle_heap: the start-up heap leaves the collector's oldest generation, and every collection is timed."""
import gc

import pytest

from common.telemetry.metrics import Metrics
from common.heap import _PauseTimer, freeze_imports, settle_heap, watch_pauses


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
    assert frozen >= 50_000 and gc.get_freeze_count() == frozen
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


def test_after_the_imports_are_frozen_settling_walks_only_what_came_since(restore_gc):
    freeze_imports()
    frozen = gc.get_freeze_count()
    since = [[i] for i in range(2_000)]  # what loading makes after the imports
    cycle = [None]
    cycle[0] = cycle  # and garbage among it, which the settling collection frees
    del cycle
    collected = []
    gc.callbacks.append(lambda phase, info: collected.append(info["collected"]) if phase == "stop" else None)
    settle_heap()
    assert collected and collected[-1] >= 1
    assert frozen + len(since) <= gc.get_freeze_count() < frozen + len(since) + 1_000

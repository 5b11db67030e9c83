"""Keep the cyclic garbage collector's pauses out of token streams.

A service imports torch, transformers and grpc and loads a model: about a quarter of a million objects that live as
long as the process. CPython's oldest-generation collection walks every one of them with the GIL held (150 ms on a
2-core CI machine, tens of ms on a GPU host), and it runs whenever enough objects have outlived the younger
generations: under load, every few seconds. Each such pause stops the engine thread between steps and the event
loop between messages, so every running request gets one inter-token gap of that length.

`settle_heap` runs one collection while nothing is served yet, then freezes what is left (`gc.freeze`, as vLLM does
after its start-up): later collections skip the frozen objects and walk only what serving itself keeps alive.
`disagg_gc_pause_seconds` shows what pauses remain, by generation.
"""
from __future__ import annotations

import atexit
import gc
import logging
import time

from common.telemetry.metrics import Metrics

log = logging.getLogger(__name__)


def settle_heap(metrics: Metrics | None = None) -> int:
    """Collect once, freeze the survivors and (with `metrics`) time every later collection; the frozen count.
    Call it once start-up has built what the process keeps (the model, the tokenizer, the servers), before the
    first request."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    # At exit the frozen objects go back to the collector: frozen, the interpreter's last collections skip them, and
    # triton's bindings (nanobind) then report every one of their objects still alive as a leak on stderr. (The
    # services skip finalising altogether, services.kit.process_exit; this is for the bench client and callers.)
    atexit.register(gc.unfreeze)
    frozen = gc.get_freeze_count()
    log.info("froze %d start-up objects out of the garbage collector's way (%.0f ms)", frozen,
             (time.perf_counter() - started) * 1000)
    if metrics is not None:
        watch_pauses(metrics)
    return frozen


def watch_pauses(metrics: Metrics) -> None:
    """Observe every collection's duration into `disagg_gc_pause_seconds{generation}` (one timer a process: a
    second call, with another registry, replaces the first)."""
    gc.callbacks[:] = [cb for cb in gc.callbacks if not isinstance(cb, _PauseTimer)]
    gc.callbacks.append(_PauseTimer(metrics))


class _PauseTimer:
    """A gc callback: called with "start" and "stop" around each collection, on the collecting thread, GIL held."""

    def __init__(self, metrics: Metrics):
        self._histograms = [metrics.get("disagg_gc_pause_seconds", generation=str(g)) for g in range(3)]
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._histograms[info["generation"]].observe(time.perf_counter() - self._started)

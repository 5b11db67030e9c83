"""A helper core for a CPU worker's prefill GEMMs: half the rows of each big bf16 GEMM run on a core the worker's
model does not own, while that core is idle.

`disagg up` gives each CPU worker's model cores of its own (common/cpu_cores.py) and names the others in
DISAGG_HELPER_CORES. On 2 cores in the default 1 prefill + 1 decode layout, the prefill worker's helper is the decode
worker's core: at concurrency 1 it idles while a prompt is prefilled (the decode of the request before has ended).
The helper thread runs under SCHED_IDLE, so anything else that wants its core (the decode worker's model, the router,
another job) preempts it at once; and the engine thread never waits on it for long: a half the helper has not begun
when the engine's own half is done, the engine computes itself, and a half it began is waited for at most as long as
the engine's half took (then computed again by the engine, the helper's answer dropped). After a half the helper did
not take, the engine runs GEMMs whole for BACKOFF_S, so a busy core costs a split every 50 ms at most.

Why not a second OpenMP thread: a barrier waits for its slowest thread, and a thread on a core the decode worker is
using waits a scheduler slice at each one (docs/benchmarks/vllm_cpu.md: 940 ms against 24 for one forward's GEMMs).
Measured (SmolLM2-135M bf16, a 128-token prompt, the engine in-process on core 0, the helper on core 1): the prefill
step 174 -> 132 ms with core 1 idle; docs/benchmarks/vllm_cpu.md has the serving figures.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from functools import cache
from typing import Callable

import torch

from common.cpu_cores import HELPER_CORES_ENV, can_pin, parse_cores

log = logging.getLogger(__name__)
MIN_ROWS = 64  # a prefill chunk's GEMM (a few ms); a decode step's rows stay whole (its GEMMs take ~0.1 ms)
BACKOFF_S = 0.05

Rows = Callable[[torch.Tensor], torch.Tensor]


@dataclass(eq=False)
class _Half:
    rows: Rows
    x: torch.Tensor
    taken: bool = False  # by the helper (under the lock), or given up by the engine
    out: torch.Tensor | None = None
    done: threading.Event = field(default_factory=threading.Event)


class HelperCore:
    """A thread on `cores` (SCHED_IDLE, one torch thread) that computes the second half of a GEMM's rows."""

    def __init__(self, cores: tuple[int, ...]):
        self.cores = cores
        self._halves: queue.SimpleQueue[_Half] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._quiet_until = 0.0
        self._thread = threading.Thread(target=self._serve, name="cpu-helper", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        torch.set_num_threads(1)  # OpenMP's thread count is per thread: a new one would start one a core
        if can_pin():
            os.sched_setaffinity(0, self.cores)
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError) as exc:  # not Linux: the helper still works, at normal priority
            log.info("the CPU helper thread runs at normal priority (%s)", exc)
        while True:
            half = self._halves.get()
            with self._lock:
                if half.taken:
                    continue
                half.taken = True
            try:
                half.out = half.rows(half.x)
            except Exception:  # the engine computes this half itself; `split` offers no more (none would be taken)
                log.exception("the CPU helper thread failed: prefill GEMMs run whole from now on")
                return
            finally:
                half.done.set()

    def split(self, rows: Rows, x: torch.Tensor) -> torch.Tensor:
        """rows(x) with its second half of rows offered to the helper (see the module doc)."""
        if time.monotonic() < self._quiet_until or not self._thread.is_alive():
            return rows(x)
        middle = x.shape[0] // 2
        half = _Half(rows, x[middle:])
        self._halves.put(half)
        started = time.monotonic()
        first = rows(x[:middle])
        mine = time.monotonic() - started
        with self._lock:
            helped, half.taken = half.taken, True
        if helped and half.done.wait(mine) and half.out is not None:
            return torch.cat((first, half.out))
        self._quiet_until = time.monotonic() + BACKOFF_S
        return torch.cat((first, rows(x[middle:])))


@cache
def helper() -> HelperCore | None:
    """This process's helper, on the cores DISAGG_HELPER_CORES names; None where unset or empty."""
    cores = parse_cores(os.environ.get(HELPER_CORES_ENV, ""))
    return HelperCore(cores) if cores else None


def applies(x: torch.Tensor) -> bool:
    """Whether a GEMM of `x` is split: a prefill chunk's rows, one torch thread (the worker's model on one core; with
    more, torch spreads the GEMM itself), and a helper configured."""
    return x.dim() == 2 and x.shape[0] >= MIN_ROWS and torch.get_num_threads() == 1 and helper() is not None

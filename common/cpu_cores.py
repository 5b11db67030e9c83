"""Which cores a CPU worker's model runs on. `disagg up` gives each CPU worker cores of its own in
DISAGG_MODEL_CORES (and OMP_NUM_THREADS, one torch thread a core); the threads that run the model (the loading
thread and the engine loop, through common.devices.bind_thread) pin themselves to them, so the OpenMP threads
they start inherit them. Everything else of the process (asyncio, gRPC, the KV data plane) stays where the
process started: the cores `disagg up` left to the router and to such threads.

Why: an OpenMP barrier waits for its slowest thread, and a model thread that shares a core with the router or
another worker waits a scheduler slice (milliseconds) for it, while a SmolLM2-135M layer's GEMM takes ~0.2 ms.
"""
from __future__ import annotations

import os

MODEL_CORES_ENV = "DISAGG_MODEL_CORES"
HELPER_CORES_ENV = "DISAGG_HELPER_CORES"  # idle cores a prefill GEMM may borrow (common/engine/cpu_helper.py)


def parse_cores(text: str) -> tuple[int, ...]:
    """`0,2-3` -> (0, 2, 3): the list form of taskset and /sys/devices/system/cpu/online."""
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return tuple(sorted(set(cores)))


def format_cores(cores: tuple[int, ...]) -> str:
    return ",".join(map(str, cores))


def can_pin() -> bool:
    """Whether this OS lets a process choose its threads' cores (Linux does; macOS has no sched_setaffinity)."""
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def usable_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity: taskset, cgroups' cpusets; all of them where the OS has
    no affinity)."""
    if not can_pin():
        return tuple(range(os.cpu_count() or 1))
    return tuple(sorted(os.sched_getaffinity(0)))


def pin_model_thread() -> tuple[int, ...] | None:
    """Pin the calling thread to DISAGG_MODEL_CORES, where set; returns them (None: not set, nothing done)."""
    text = os.environ.get(MODEL_CORES_ENV)
    if not text or not can_pin():
        return None
    cores = parse_cores(text)
    os.sched_setaffinity(0, cores)  # 0: the calling thread; threads it starts (OpenMP's) inherit it
    return cores

"""Cores for `disagg up --device cpu`: each worker's model gets cores of its own (its engine loop and its OpenMP
threads pin themselves there: common/cpu_cores.py), one torch thread a core; the router and the workers' other
threads (asyncio, gRPC, the KV data plane) get what is left. Pure: the cores are passed in, so it is tested on any
machine.

    cpu_layout((0, 1), ["decode-0"])              # decode-0's model on core 0; router and the rest on core 1
    cpu_layout((0, 1), ["prefill-0", "decode-0"])  # one core each; the router shares both

Why: vLLM's CPU backend does the same (OpenMP threads bound to cores, one core kept for its API server and engine
loop). An OpenMP barrier waits for its slowest thread, so a model thread that shares its core with the router or
another worker waits a scheduler slice (milliseconds) where a layer's GEMM takes a fraction of one.
A model on one core also gets the other cores in DISAGG_HELPER_CORES: half the rows of a prompt's GEMMs run there
while one idles, on a thread of idle priority that anything else preempts (common/engine/cpu_helper.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.cpu_cores import HELPER_CORES_ENV, MODEL_CORES_ENV, format_cores


@dataclass(frozen=True)
class CpuLayout:
    model_cores: dict[str, tuple[int, ...]]  # worker name -> the cores its model runs on
    other_cores: tuple[int, ...]  # where every process starts: the router's, and each worker's non-model threads
    user_threads: str | None = field(default=None)  # OMP_NUM_THREADS as the user set it: kept, not ours

    def env(self, name: str) -> dict[str, str]:
        """The worker's environment: its model's cores, and a torch thread per core unless the user chose; a model
        on one core of its own also gets the others as helper cores (common/engine/cpu_helper.py: half of a prefill
        chunk's GEMM rows where one is idle)."""
        cores = self.model_cores[name]
        env = {MODEL_CORES_ENV: format_cores(cores)}
        if self.user_threads is None:
            env["OMP_NUM_THREADS"] = str(len(cores))
            helpers = self.helper_cores(name)
            if len(cores) == 1 and helpers:
                env[HELPER_CORES_ENV] = format_cores(helpers)
        return env

    def helper_cores(self, name: str) -> tuple[int, ...]:
        """Every core of the layout but the worker's model's."""
        every = set(self.other_cores).union(*self.model_cores.values())
        return tuple(sorted(every - set(self.model_cores[name])))

    def describe(self) -> str:
        """One line for the summary."""
        models = ", ".join(f"{name} on {_cores_text(cores)}" for name, cores in self.model_cores.items())
        threads = (f"OMP_NUM_THREADS={self.user_threads} (yours)" if self.user_threads is not None
                   else "a torch thread a core")
        borrow = any(HELPER_CORES_ENV in self.env(name) for name in self.model_cores)
        return (f"CPU cores: models {models} ({threads}); router and other threads on {_cores_text(self.other_cores)}"
                + ("; with --dtype bfloat16 a prompt's GEMMs borrow the other cores while idle" if borrow else ""))


def cpu_layout(cores: tuple[int, ...], workers: list[str], user_threads: str | None = None) -> CpuLayout:
    """More cores than workers: the last core for the router and the workers' other threads, the rest split among
    the models in order (a remainder to the last workers, the decode ones). Otherwise a core each, round-robin,
    and everything else runs anywhere."""
    if len(cores) > len(workers):
        spare, models = cores[-1:], cores[:-1]
        share, extra = divmod(len(models), len(workers))
        sizes = [share + (i >= len(workers) - extra) for i in range(len(workers))]
        starts = [sum(sizes[:i]) for i in range(len(workers))]
        placed = {w: models[s:s + n] for w, s, n in zip(workers, starts, sizes)}
        return CpuLayout(placed, spare, user_threads)
    return CpuLayout({w: (cores[i % len(cores)],) for i, w in enumerate(workers)}, cores, user_threads)


def _cores_text(cores: tuple[int, ...]) -> str:
    return f"core {cores[0]}" if len(cores) == 1 else f"cores {format_cores(cores)}"

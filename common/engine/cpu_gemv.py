"""A decode step's batch-1 bf16 GEMVs with the helper core (cpu_gemv.c): at concurrency 1 on a 2-core machine the
prefill worker's core idles while the decode worker steps, and a one-row GEMV is bound by one core's memory
bandwidth. Sharing its rows with a thread there (DISAGG_HELPER_CORES, which `disagg up` sets; SCHED_IDLE, so the
prefill worker and the router preempt it) reads the weights through two cores.

On one core this kernel is a little slower than oneDNN's; shared with an idle second core, a forward's one-row GEMMs
take about two thirds of oneDNN's time. The kernel accumulates in float32 with the CPU's bf16 dot products as oneDNN
does, rows rounded to bf16 once: the same values up to the order of the sums. Only bf16 on one torch thread (a worker on
a core of its own) with a helper core named; float32 keeps MKL, the arithmetic of the Hugging Face reference."""
from __future__ import annotations

import ctypes
import os
from functools import cache

import torch

from common.cpu_cores import HELPER_CORES_ENV, parse_cores
from common.engine.cpu_build import library

# Input rows shared so (the kernel takes up to 8, cpu_gemv.c's MAX_M). One: with 8 rows the prefill worker's core is
# busy, sharing gains no inter-token latency and costs TTFT, as the prefill's own borrowed-core GEMMs (cpu_helper)
# meet this helper there.
MAX_ROWS = 1
WAIT_US = 50  # longest the engine waits for a chunk the helper holds (a chunk takes ~5 us) before computing it itself
_held: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []  # inputs the helper may still read


@cache
def _lib() -> ctypes.CDLL | None:
    cores = parse_cores(os.environ.get(HELPER_CORES_ENV, ""))
    if not cores:
        return None
    built = library("cpu_gemv.c")
    if built is None or not built.gemv_available():
        return None
    built.gemv_bf16.restype = ctypes.c_int64
    built.gemv_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    if built.gemv_start(ctypes.c_int(cores[0])) != 0:
        return None
    return built


def applies(x: torch.Tensor) -> bool:
    """Whether a GEMM of `x` goes here: a decode step's few bf16 rows on one torch thread, a helper core named, the
    kernel built."""
    return (x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16 and torch.get_num_threads() == 1 and _lib() is not None
            and x.is_contiguous())


def gemv(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """x [m, in] @ weight.T [in, out] (+ bias): [m, out] bf16. `weight` contiguous bf16 [out, in]."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)
    result = _lib().gemv_bf16(weight.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(),
                              out.data_ptr(), x.shape[0], weight.shape[1], weight.shape[0], 1, WAIT_US)
    if result & 1:  # the helper, preempted in a chunk taken back from it, may still read them
        _held.append((weight, bias, x))
    else:
        _held.clear()
    return out

"""Which GPU a thread works on. CUDA's current device belongs to each host thread and starts at GPU 0, and Triton
launches on the current device: an engine on cuda:N must make cuda:N current in every thread that runs its work
(the loading thread, the engine loop, the data plane's executor threads), or its kernels meet GPU 0's context
(Triton: "Pointer argument (at 0) cannot be accessed from Triton") and its streams and events land on GPU 0."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import torch


def bind_thread(device: str | torch.device | None) -> None:
    """Make `device` the calling thread's current CUDA device; nothing for the CPU (or None)."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)


# A GPU worker's host-side tensor work (a step's small index and copy tensors) gains nothing from an OpenMP pool a core
# wide, and several workers on a many-core host, each with one (64 threads apiece on a 4-GPU host), took the engine
# threads' cores: decode steps of 16-20 ms among 5-6 ms ones, ITL p99 19.5 against 10.5 ms at one rate
# (docs/benchmarks/multi_gpu.md).
GPU_HOST_THREADS = 4


def limit_host_threads(device: str | torch.device | None) -> None:
    """On a GPU, torch's intra-op pool to GPU_HOST_THREADS, unless the user set OMP_NUM_THREADS; nothing for the
    CPU, whose threads are the model's (common/cpu_cores.py)."""
    if device is None or torch.device(device).type != "cuda" or "OMP_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(min(GPU_HOST_THREADS, torch.get_num_threads()))


def bind_loop_executor(loop: asyncio.AbstractEventLoop, device: str | torch.device | None) -> None:
    """`device` current in this thread and in every thread of the loop's default executor (asyncio.to_thread's)."""
    bind_thread(device)
    if device is not None and torch.device(device).type == "cuda":
        loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="asyncio-cuda", initializer=bind_thread,
                                                     initargs=(device,)))


CAPTURE_ERROR_MODE = "thread_local"  # every capture's (graph_capture says why); prefill_graphs captures by hand
_capture_streams: dict[int, torch.cuda.Stream] = {}
_capture_lock = threading.Lock()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream of `device` to capture its CUDA graphs on. torch.cuda.graph's default is one stream for the
    whole process, made on whichever GPU was current at the first capture; `with torch.cuda.stream(s)` makes s's GPU
    current, so a later capture for another GPU would launch its kernels (Triton's, on the current device) on the
    first one: refused ("cannot be accessed from Triton") or, with peer access on, reading the wrong memory."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _capture_lock:
        if index not in _capture_streams:
            _capture_streams[index] = torch.cuda.Stream(device=index)
        return _capture_streams[index]


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, device: torch.device,
                  pool: tuple[int, int] | None = None) -> Iterator[None]:
    """Capture into `graph` on `device`'s capture stream. Only this thread's CUDA calls may break the capture
    ("thread_local"): in torch's default mode ("global") any other thread's call that is unsafe during a capture
    invalidates it, and other threads do call CUDA meanwhile: the NCCL teardown a closed TP engine leaves running in the
    background (a later TP engine built in the same process then fails its capture, "operation failed due to a previous
    error during capture"), a KV puller checking cuda_ipc as a worker starts. The cyclic GC is off meanwhile, so that no
    collection on this thread frees CUDA objects (events, streams, communicators) mid-capture."""
    with collector_paused(), torch.cuda.graph(graph, pool=pool, stream=capture_stream(device),
                                              capture_error_mode=CAPTURE_ERROR_MODE):
        yield


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic GC off for the block (a capture: no collection may free CUDA objects mid-capture), then as it was."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()

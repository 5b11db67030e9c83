"""How many KV blocks a worker's cache holds: a count it was given, or, on a GPU, what fits in its share of the
device's memory once its own weights, its CUDA context and one step's activations are counted.

A worker counts only what it uses itself, never what the device has in use: two workers on one GPU (1 prefill +
1 decode, `disagg up`'s one-GPU layout) each take their share whichever loads first, instead of the later one
counting the earlier one's KV cache as its own. What the device has free still bounds the cache (a process
that is not ours may hold memory): that cap is named in the log line when it binds.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from common.errors import InvalidConfig

log = logging.getLogger(__name__)

# The CUDA context, its kernel modules and the libraries' handles live outside torch's allocator; where NVML cannot
# read this process's own use, this much is counted for them (a context with cuBLAS and Triton's modules loaded
# takes under 1 GiB).
NON_TORCH_ALLOWANCE_BYTES = 1 << 30
# Of what the device has free when the cache is made, this much stays free: CUDA graphs captured afterwards, and
# the allocator's fragmentation.
FREE_MARGIN_BYTES = 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """What the sizing reads of the device and of this process, in bytes."""

    total: int
    free: int  # on the device, whoever holds the rest
    torch_reserved: int  # this process's torch allocator (its weights, once loaded)
    non_torch: int  # this process's use outside torch's allocator (the CUDA context)


def kv_blocks_for_share(share: float, memory: DeviceMemory, block_bytes: int, reserve_bytes: int) -> tuple[int, str]:
    """Blocks of `block_bytes` in `share` of the device less this process's own use and a step's `reserve_bytes`,
    and at most what its free memory holds past FREE_MARGIN_BYTES; with the line that says how they were sized.
    InvalidConfig when not even one fits."""
    own = memory.torch_reserved + memory.non_torch
    budget = int(memory.total * share) - own - reserve_bytes
    free_cap = memory.free - reserve_bytes - FREE_MARGIN_BYTES
    blocks = max(min(budget, free_cap), 0) // block_bytes
    gib = 1 << 30
    if blocks < 1:
        raise InvalidConfig(
            f"--gpu-memory-utilization {share:g}: of {memory.total / gib:.1f} GiB this worker's share is "
            f"{memory.total * share / gib:.1f}; its weights and context take {own / gib:.1f}, a step needs "
            f"~{reserve_bytes / gib:.1f} more and the device has {memory.free / gib:.1f} free, which leaves no room "
            f"for a KV block of {block_bytes} bytes; raise it, run fewer workers on the GPU or use a smaller "
            "--max-num-batched-tokens")
    line = (f"KV cache: {blocks} blocks ({blocks * block_bytes / gib:.1f} GiB), {share:g} of the GPU's "
            f"{memory.total / gib:.1f} GiB less this worker's {own / gib:.1f} GiB of weights and context and "
            f"{reserve_bytes / gib:.1f} GiB for a step")
    if free_cap < budget:
        line += (f"; capped by the device's free memory ({memory.free / gib:.1f} GiB): another process holds more "
                 "than the rest of the GPU")
    return blocks, line


def read_device_memory(device) -> DeviceMemory:
    """The device's memory and this process's own use of it (call after loading the weights)."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    used_by_us = _nvml_process_bytes(device)
    non_torch = NON_TORCH_ALLOWANCE_BYTES if used_by_us is None else max(used_by_us - reserved, 0)
    return DeviceMemory(total=total, free=free, torch_reserved=reserved, non_torch=non_torch)


def _nvml_process_bytes(device) -> int | None:
    """This process's memory on `device` as the driver counts it (NVML), or None where NVML cannot say."""
    try:
        import pynvml  # nvidia-ml-py, where installed (torch.cuda's own memory queries use it too)
    except ImportError:
        return None
    import torch

    try:
        pynvml.nvmlInit()
        index = torch.cuda.get_device_properties(device).uuid
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{index}")
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid() and process.usedGpuMemory:
                return int(process.usedGpuMemory)
    except Exception as exc:  # pynvml raises its own NVMLError kinds; a container may hide processes
        log.debug("NVML cannot read this process's GPU memory: %s", exc)
    return None

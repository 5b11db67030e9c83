"""Host buffers that a KV pull writes once at memory speed: backed by transparent huge pages where the kernel
offers them (THP `always` or `madvise`).

A fresh buffer's 4 KiB pages each fault on first touch, and for a session's tens of megabytes written once those
faults cost several times the copy itself; 2 MiB pages fault 512 times less often. The region is an anonymous
mapping of its own, so it goes back to the kernel as soon as the last tensor over it is gone.
"""
from __future__ import annotations

import mmap

import torch

HUGE_PAGE_BYTES = 2 * 1024 * 1024  # below one huge page, the allocator's own memory is as good


def host_empty(num_bytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of `num_bytes` on the host (pageable), in huge pages where it is large."""
    if num_bytes < HUGE_PAGE_BYTES:
        return torch.empty(num_bytes, dtype=torch.uint8)
    region = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere plain pages
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8)  # holds `region` until the tensor's storage is freed

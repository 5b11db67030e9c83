"""A step's small host arrays (token ids, positions, attention metadata) onto the device in one copy.

Each array through `Tensor.pin_memory()` (which checks `is_pinned()` first) and its own copy costs the host a pinning
check and a copy launch per array, nine of them for a prefill's metadata: packed, a third less host time a prompt step
(`python -m benchmarks.gpu_host_upload`). The arrays go into one buffer from torch's caching host allocator
(`empty(pin_memory=True)`: no check, and the allocator keeps the buffer until the copy has run) and cross in one
non-blocking copy; each array is a view of the device buffer.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

_ALIGN = 16  # bytes: every view starts where any dtype here may start


def upload(arrays: Sequence[np.ndarray | Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """Each of `arrays` (numpy arrays, or lists of ints as int64) as a tensor on `device`, in the same order and
    shapes. On a GPU, one pinned staging buffer and one copy that does not wait for the device; on the CPU, fresh
    tensors."""
    arrays = [np.ascontiguousarray(a if isinstance(a, np.ndarray) else np.asarray(a, dtype=np.int64))
              for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    cuda = device.type == "cuda"
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=cuda)
    flat = host.numpy()
    for a, off in zip(arrays, offsets):
        flat[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
    buf = host.to(device, non_blocking=True) if cuda else host
    return [buf[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape) for a, off in zip(arrays, offsets)]


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.int16): torch.int16,
                 np.dtype(np.uint8): torch.uint8, np.dtype(np.bool_): torch.bool, np.dtype(np.float32): torch.float32}

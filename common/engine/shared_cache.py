"""The KV cache of a tensor-parallel engine on the CPU: one tensor of every KV head in shared memory.

Every rank maps the same /dev/shm file and computes attention on its own heads only, a view
`cache[..., first:last, :]`, so the KV heads (and their blocks) are split across ranks while rank 0, which
owns the block manager, the sessions and the KV data plane, sees the whole cache as one engine does. A
session leaves and arrives with every head whatever the TP size on either side, so prefill at TP=a hands off
to decode at TP=b with no conversion step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from common.kv import shm_files


@dataclass(frozen=True)
class SharedKvCache:
    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype) -> "SharedKvCache":
        path = shm_files.new_file("disagg-tp-kv-", torch.Size(shape).numel() * dtype.itemsize)  # zeroed, as torch.zeros
        return cls(str(path), tuple(shape), dtype)

    def open(self) -> torch.Tensor:
        numel = torch.Size(self.shape).numel()
        return torch.from_file(self.path, shared=True, size=numel, dtype=self.dtype).view(self.shape)

    def unlink(self) -> None:
        """Once every rank has mapped it: the memory lives on in the mappings, and no file outlives them."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

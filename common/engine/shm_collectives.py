"""All-reduce and all-gather for the ranks of one CPU host, through shared memory instead of gloo's TCP.

gloo hands every collective to a thread of its own and sends it over loopback TCP: about 0.9 ms for a few
kilobytes between two idle processes here, and a decode step of a 30-layer model makes 61 of them. Ranks that
share a host can meet in memory instead (as vLLM's CPU backend does): each rank copies its tensor into its
slot, publishes the collective's sequence number, waits until every rank has published it, and reads every slot.
Every rank adds the slots in rank order, so all ranks hold the same bits, as the model requires.

Two sets of slots alternate, so a rank may write collective k+1 while a slower one still reads collective k:
a rank publishes k+1 only after it has read k, and writing k+2 into k's set waits for every rank to publish k+1.
Only where x86-64's store order holds (a store is seen after the stores before it): elsewhere gloo does it all.
"""
from __future__ import annotations

import mmap
import os
import platform

import numpy as np
import torch

from common.kv import shm_files

SLOT_BYTES = 8 << 20  # a [2048, 1024] float32 step's activations; a larger tensor goes through gloo
_COUNTER_STRIDE = 8  # int64s between two ranks' counters: one 64-byte cache line each
_SPINS_BEFORE_YIELD = 64


def supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def create(size: int) -> str:
    """A zeroed region for `size` ranks (rank 0 makes it and hands its path to the others)."""
    return str(shm_files.new_file("disagg-tp-collectives-", _region_bytes(size)))


def _region_bytes(size: int) -> int:
    return size * _COUNTER_STRIDE * 8 + 2 * size * SLOT_BYTES


class ShmCollectives:
    def __init__(self, path: str, rank: int, size: int):
        self.rank, self.size = rank, size
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _region_bytes(size))
        counter_bytes = size * _COUNTER_STRIDE * 8
        self._counters = np.frombuffer(self._map, dtype=np.int64, count=size * _COUNTER_STRIDE)[::_COUNTER_STRIDE]
        slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=counter_bytes, count=2 * size * SLOT_BYTES)
        self._slots = slots.view(2, size, SLOT_BYTES)
        self._seq = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= SLOT_BYTES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x ← the sum over ranks, added in rank order (the same bits on every rank)."""
        parts = self._exchange(x)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return x.copy_(total.view_as(x))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dimension, in rank order."""
        return torch.cat([part.view_as(x) for part in self._exchange(x)], dim=-1)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish x, wait for every rank's, and return them (views of the shared slots, read before the next
        collective but one can overwrite them)."""
        self._seq += 1
        slots = self._slots[self._seq % 2]
        nbytes = x.numel() * x.element_size()
        mine = slots[self.rank, :nbytes].view(x.dtype)
        mine.copy_(x.reshape(-1))
        self._counters[self.rank] = self._seq  # after the data: x86 keeps stores in order
        self._wait_for(self._seq)
        return [slots[r, :nbytes].view(x.dtype) for r in range(self.size)]

    def _wait_for(self, seq: int) -> None:
        spins = 0
        while self._counters.min() < seq:
            spins += 1
            if spins >= _SPINS_BEFORE_YIELD:  # more ranks than free cores: let the others run
                os.sched_yield()

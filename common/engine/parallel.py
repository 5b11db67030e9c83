"""Tensor parallelism: which rank this process is, and the two collectives a sharded model needs.

Megatron's split, as vLLM and nano-vllm do it: column-parallel fused qkv and gate_up (each rank computes its
heads and its slice of the MLP), row-parallel o_proj and down_proj (each rank a partial sum, then one
all-reduce), vocab-parallel embedding (an all-reduce) and lm head (an all-gather of the logits). One process
per rank; the group is a torch.distributed process group object of its own (gloo), not the global default
group, so one process can build and drop engines (the tests do) and a worker never touches global state. The
ranks share a host, so the collectives of a step go through shared memory (shm_collectives.py) where they fit,
and through gloo otherwise.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import os

import torch
import torch.distributed as dist

from common.engine import shm_collectives
from common.engine.shm_collectives import ShmCollectives
from common.errors import InvalidConfig

# A collective waits this long for its peers; a rank that dies is noticed by its process watcher long before.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
_SHM_KEY = "shm_collectives"


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    shm: ShmCollectives | None = None

    @classmethod
    def join(cls, store: dist.Store, rank: int, size: int) -> "TensorParallel":
        """This rank's place in a group of `size` ranks meeting at `store` (blocks until every rank joined)."""
        tp = cls(rank, size, dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT))
        if size > 1 and shm_collectives.supported():
            if rank == 0:
                store.set(_SHM_KEY, shm_collectives.create(size))
            path = store.get(_SHM_KEY).decode()
            tp.shm = ShmCollectives(path, rank, size)
            tp.group.allreduce([torch.zeros(1)]).wait()  # every rank has mapped it: the file can go
            if rank == 0:
                os.unlink(path)
        return tp

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, MLP columns); InvalidConfig when it does not divide."""
        if total % self.size:
            raise InvalidConfig(f"--tensor-parallel-size {self.size} does not divide the model's {total} {what}")
        return total // self.size

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of the vocabulary rows this rank holds: equal shares, the last one padded."""
        per = -(-vocab_size // self.size)
        return self.rank * per, min((self.rank + 1) * per, vocab_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (a row-parallel layer's partial products)."""
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        self.group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dimension, in rank order (a vocab-parallel lm head)."""
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather(x)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()

"""Tensor parallelism: which rank this process is, and the two collectives a sharded model needs.

Megatron's split, as vLLM and nano-vllm do it: column-parallel fused qkv and gate_up (each rank computes its
heads and its slice of the MLP), row-parallel o_proj and down_proj (each rank a partial sum, then one
all-reduce), vocab-parallel embedding (an all-reduce) and lm head (an all-gather of the logits). One process
per rank; the group is a torch.distributed process group object of its own, not the global default group, so
one process can build and drop engines (the tests do) and a worker never touches global state. On GPUs it is
NCCL, rank r on GPU base + r (`rank_device`), and a step's collectives are captured in its CUDA graphs. On the
CPU it is gloo, and as the ranks share a host a step's collectives go through shared memory
(shm_collectives.py) where they fit.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.engine import shm_collectives
from common.engine.shm_collectives import ShmCollectives
from common.errors import InvalidConfig

log = logging.getLogger(__name__)
_leaving: list[threading.Thread] = []


def teardowns_finished(timeout_s: float) -> bool:
    """Whether the NCCL teardowns `leave` left running have finished, waiting `timeout_s` at most for them. A process
    must not finalise while one runs: ProcessGroupNCCL.shutdown in a thread at interpreter exit aborts ("terminate
    called without an active exception", exit -6, as a TP worker whose follower has gone exits)."""
    deadline = time.monotonic() + timeout_s
    for thread in _leaving:
        thread.join(max(0.0, deadline - time.monotonic()))
    _leaving[:] = [thread for thread in _leaving if thread.is_alive()]
    return not _leaving


# A collective waits this long for its peers; a rank that dies is noticed by its process watcher long before.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
_SHM_KEY = "shm_collectives"


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    shm: ShmCollectives | None = None
    store: dist.Store | None = None  # the rendezvous, where ranks also leave what they share (their KV caches)

    @classmethod
    def join(cls, store: dist.Store, rank: int, size: int, device: torch.device | None = None) -> "TensorParallel":
        """This rank's place in a group of `size` ranks meeting at `store` (blocks until every rank joined):
        NCCL where `device` is a GPU (this rank's: `rank_device`), gloo otherwise."""
        if device is not None and device.type == "cuda":
            # No flight recorder (it takes the GIL from the watchdog thread) and no heartbeat monitor: a rank that
            # dies is noticed by rank 0's process watch (tp_ranks.py), which takes the whole worker down.
            os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")  # once TORCH_NCCL_TRACE_BUFFER_SIZE
            os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)
            tp = cls(rank, size, group, store=store)
            tp.all_reduce(torch.zeros(1, device=device))  # the communicator, made before any graph captures it
            return tp
        tp = cls(rank, size, dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, COLLECTIVE_TIMEOUT),
                 store=store)
        if size > 1 and shm_collectives.supported():
            if rank == 0:
                store.set(_SHM_KEY, shm_collectives.create(size))
            path = store.get(_SHM_KEY).decode()
            tp.shm = ShmCollectives(path, rank, size)
            tp.group.allreduce([torch.zeros(1)]).wait()  # every rank has mapped it: the file can go
            if rank == 0:
                os.unlink(path)
        return tp

    def leave(self, timeout_s: float = 2.0) -> None:
        """Start tearing down an NCCL communicator while its peers are alive (every rank calls this as the engine
        closes). Left to outlive its peers, its watchdog meets their exit later, and a process that builds one TP engine
        after another hangs building a later one (tests/gpu/test_tensor_parallel_gpu.py). ProcessGroupNCCL.shutdown may
        take many seconds to return, yet starting it is what matters: it runs in a daemon thread, waited for `timeout_s`
        at most, and is left to finish in the background; a worker's exit asks teardowns_finished first."""
        shutdown = getattr(self.group, "shutdown", None)
        if self.size == 1 or shutdown is None or not isinstance(self.group, getattr(dist, "ProcessGroupNCCL", ())):
            return
        thread = threading.Thread(target=shutdown, name=f"tp-leave-{self.rank}", daemon=True)
        thread.start()
        _leaving.append(thread)
        thread.join(timeout_s)
        if thread.is_alive():
            log.info("tensor-parallel rank %d: the NCCL communicator is still shutting down; left to finish in the "
                     "background", self.rank)
        self.group = None

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
        if x.is_cuda:  # one flat gather (what a CUDA graph captures), then rank-major to the last dimension
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            self.group._allgather_base(out, x).wait()
            return out.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def min(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV blocks each rank's memory has room for)."""
        if self.size == 1:
            return value
        on_gpu = self.group.name() == "nccl"
        t = torch.tensor([value], dtype=torch.long, device=torch.cuda.current_device() if on_gpu else "cpu")
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], options).wait()
        return int(t.item())


def check_devices(device: str, size: int) -> None:
    """InvalidConfig unless `size` ranks have a device each: GPUs base..base+size-1 on CUDA (the CPU has room for
    any)."""
    base = torch.device(device)
    if base.type != "cuda" or size == 1:
        return
    first, have = base.index or 0, torch.cuda.device_count()
    if first + size > have:
        raise InvalidConfig(f"--tensor-parallel-size {size} on --device {device} needs GPUs cuda:{first}..cuda:"
                            f"{first + size - 1}, one a rank; this process sees {have}")


def rank_device(device: str, rank: int) -> torch.device:
    """Rank `rank`'s device of an engine configured on `device`: GPU index + rank on CUDA, the CPU otherwise."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


SINGLE = TensorParallel()

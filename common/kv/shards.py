"""A tensor-parallel engine's KV cache on several GPUs, seen by the KV data plane as one cache.

Rank r of a TP=n engine on GPUs computes on its own heads [r*h, (r+1)*h) in a cache of its own on its own GPU,
contiguous as the attention kernels want it. Rank 0 maps every other rank's cache through CUDA IPC, and this
class is what it hands the data plane: the logical cache [layers, 2, blocks, block_size, n*h, head_dim], read
and written per block across the shards. A session therefore leaves and arrives with every head, whatever the TP
size on either side, as from a CPU engine's one shared cache (common/engine/shared_cache.py).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from common.kv.words import as_words

HEAD_DIM = 4  # of [layers, 2, blocks, block_size, kv_heads, head_dim]


class KvShards:
    """`owner_shares`: for each shard another process owns, the CUDA IPC share (a serialized CudaIpcShare) its owner
    made, which is what an importer must open (memory mapped from another process cannot be shared again); None
    for the shards this process owns."""

    def __init__(self, shards: Sequence[torch.Tensor], owner_shares: Sequence[bytes | None] | None = None):
        first = shards[0]
        for shard in shards:
            if shard.shape != first.shape or shard.dtype != first.dtype:
                raise ValueError(f"KV shards {[tuple(s.shape) for s in shards]} differ")
        self.shards = list(shards)
        self.owner_shares = list(owner_shares) if owner_shares is not None else [None] * len(self.shards)
        self.heads_per_shard = first.shape[HEAD_DIM]
        heads = self.heads_per_shard * len(shards)
        self.shape = torch.Size((*first.shape[:HEAD_DIM], heads, *first.shape[HEAD_DIM + 1:]))
        self.dtype, self.device = first.dtype, first.device

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.shards[0].element_size()

    def head_slices(self) -> list[tuple[slice, torch.Tensor]]:
        """(the heads it holds in the whole cache, the shard) of every shard, in rank order."""
        h = self.heads_per_shard
        return [(slice(r * h, (r + 1) * h), shard) for r, shard in enumerate(self.shards)]

    def gather(self, block_ids: Sequence[int],
               gather_one: Callable[[torch.Tensor, Sequence[int]], torch.Tensor]) -> torch.Tensor:
        """The blocks of every head, [layers, 2, len(block_ids), block_size, all heads, head_dim], on the first
        shard's device: each shard's gathered on its own GPU by `gather_one`, then copied (a peer copy) into its
        heads."""
        out = torch.empty((*self.shape[:2], len(block_ids), *self.shape[3:]), dtype=self.dtype, device=self.device)
        for heads, shard in self.head_slices():
            out[:, :, :, :, heads].copy_(gather_one(shard, block_ids), non_blocking=True)
        return out

    def devices(self) -> list[torch.device]:
        return [shard.device for shard in self.shards]

    def scatter(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """blocks (every head) into `block_ids` of every shard, enqueued on the devices' current streams; a GPU that
        another process computes on must not read them before they have landed (the caller synchronises)."""
        for heads, shard in self.head_slices():
            index = torch.tensor(list(block_ids), dtype=torch.long).to(shard.device, non_blocking=True)
            part = blocks[:, :, :, :, heads].to(shard.device, non_blocking=True)
            if shard.dtype.itemsize == 1:  # an FP8 cache: torch has no index_copy_ of float8; the same bytes as words
                part = as_words(part)
                shard = shard.view(part.dtype)  # a shard is contiguous: any width of a row of it is a view
            shard.index_copy_(2, index, part)

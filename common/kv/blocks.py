"""A paged KV cache's blocks as the KV data plane sees them: the engine's cache and pool (KvBlocks), and block
ids read out of a cache (gather_blocks), of one tensor or of a tensor-parallel engine's shards."""
from __future__ import annotations

import ctypes
import math
from array import array
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from common.kv.fence import BlockEpochs
from common.kv.shards import KvShards
from common.kv.tiers.metrics import TierMetrics


@dataclass(frozen=True)
class KvBlocks:
    """A KvSessionHost's paged cache and its pool, for the KV data plane. Every callable is safe from any
    thread and never waits for a model step."""

    cache: torch.Tensor
    """[layers, 2, blocks, block_size, kv_heads, head_dim]."""
    reserve: Callable[[int], list[int] | None]
    """n free blocks that no step in flight writes, to import KV straight into (then generate() with a PlacedKv),
    or None when the pool is short."""
    free: Callable[[list[int]], None]
    """Give reserved blocks back."""
    count_reuse: Callable[[BlockEpochs | None], None]
    """Exporter: bump a block's epoch in this table (common.kv.fence) each time it is allocated; None stops."""
    tier_metrics: TierMetrics | None = None
    """The counts of the KV tiers below the pool (common.kv.tiers), for the worker's metrics; None: no tiers."""


MAX_RUNS = 16  # more runs of consecutive blocks than this: one indexed gather instead of a copy per run


def runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) of the maximal runs where both ids go up by one together."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            start_s, start_d, n = out[-1]
            out[-1] = (start_s, start_d, n + 1)
        else:
            out.append((s, d, 1))
    return out


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in the gathered tensor, first block id, length) of each run of consecutive block ids."""
    return runs(range(len(block_ids)), block_ids)


def gather_blocks(source: torch.Tensor | KvShards, block_ids: Sequence[int],
                  allocate: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
    """source[:, :, block_ids] on source's device, in the current stream: a block allocator mostly hands
    out consecutive blocks, and a strided copy per run moves them at copy speed, where an indexed
    gather over the middle dimension of a 6-d tensor runs several times slower. A sharded cache's blocks are
    gathered on each shard's GPU and land, every head, on its first one's. `allocate` (a plain tensor's only)
    gives the output's memory: n bytes as a uint8 tensor on source's device."""
    if isinstance(source, KvShards):
        return source.gather(block_ids, gather_blocks)
    shape = (*source.shape[:2], len(block_ids), *source.shape[3:])
    if allocate is None:
        out = torch.empty(shape, dtype=source.dtype, device=source.device)
    else:
        out = allocate(math.prod(shape) * source.element_size()).view(source.dtype).view(shape)
    spans = block_runs(block_ids)
    if len(spans) > MAX_RUNS:
        index = torch.tensor(list(block_ids), dtype=torch.long).to(source.device, non_blocking=True)
        return torch.index_select(source, 2, index, out=out)
    for position, first, length in spans:
        out[:, :, position : position + length].copy_(source[:, :, first : first + length], non_blocking=True)
    return out


def pinned_ids(src_ids: Sequence[int], dst_ids: Sequence[int]) -> torch.Tensor:
    """src_ids then dst_ids as int32 in pinned host memory (a kernel can also read it in place: unified addressing)."""
    ids = array("i", src_ids)
    ids.extend(dst_ids)
    host = torch.empty(len(ids), dtype=torch.int32, pin_memory=True)
    ctypes.memmove(host.data_ptr(), ids.buffer_info()[0], len(ids) * ids.itemsize)
    return host

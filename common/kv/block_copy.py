"""Copy blocks from one paged KV cache into another: dst[:, :, dst_ids] = src[:, :, src_ids], all layers at once.

Both caches are [layers, 2, blocks, block_size, kv_heads, head_dim]. On one GPU it is one Triton kernel
(each program moves one tile of one (layer, K/V, block) from the source block to its destination block;
the source may be another process's cache mapped through CUDA IPC), with no staging buffer and no loop
on the host. Elsewhere (CPU caches, two GPUs) it is the torch reference below.
"""
from __future__ import annotations

from array import array
from typing import Sequence

import torch

_TILE_WORDS, _WARPS = 2048, 4  # 8 KiB per program (tests/bench/kv_import_phases.py tries others)


def copy_blocks_reference(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor,
                          dst_ids: Sequence[int]) -> None:
    src_index = torch.tensor(list(src_ids), dtype=torch.long, device=src.device)
    dst_index = torch.tensor(list(dst_ids), dtype=torch.long, device=dst.device)
    dst.index_copy_(2, dst_index, src.index_select(2, src_index).to(dst.device))


class BlockCopier:
    """copy_blocks between two fixed caches (an exporter's mapped cache and this engine's), with everything that
    does not change between calls worked out once: a pull then pays for its block ids and one launch."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor):
        if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:] or src.dtype != dst.dtype:
            raise ValueError(f"caches {tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} {dst.dtype} hold "
                             "different blocks")
        self.src, self.dst = src, dst
        block_bytes = src[0, 0, 0].numel() * src.element_size()
        self._kernel = None
        if (src.is_cuda and src.device == dst.device and src.is_contiguous() and dst.is_contiguous()
                and block_bytes % 4 == 0):
            from common.kv import block_copy_triton

            self._kernel = block_copy_triton.launch
            self._words = (src.view(-1).view(torch.int32), dst.view(-1).view(torch.int32))
            self._shape = (src.shape[0] * 2, src.shape[2], dst.shape[2], block_bytes // 4, _TILE_WORDS, _WARPS)

    def __call__(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Enqueue the copy on the current stream (returns at once on a GPU)."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
        if not len(src_ids):
            return
        if self._kernel is None:
            copy_blocks_reference(self.src, src_ids, self.dst, dst_ids)
            return
        self._kernel(*self._words, self.device_ids(src_ids, dst_ids), len(src_ids), *self._shape)

    def device_ids(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> torch.Tensor:
        """The kernel's int32 ids on the GPU, queued on the current stream. A plain copy from pageable memory would
        wait for that stream (any copy queued before it, another process's turn on the GPU), on the event loop;
        non_blocking stages the bytes at once and returns."""
        ids = torch.frombuffer(array("i", [*src_ids, *dst_ids]), dtype=torch.int32)
        return ids.to(self.src.device, non_blocking=True)


def copy_blocks(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor, dst_ids: Sequence[int]) -> None:
    """Enqueue the copy on the current stream (returns at once on a GPU)."""
    BlockCopier(src, dst)(src_ids, dst_ids)

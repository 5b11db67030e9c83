"""Copy blocks from one paged KV cache into another: dst[:, :, dst_ids] = src[:, :, src_ids], all layers at once.

Both caches are [layers, 2, blocks, block_size, kv_heads, head_dim]. On one GPU it is one Triton kernel
(each program moves one tile of one (layer, K/V, block) from the source block to its destination block;
the source may be another process's cache mapped through CUDA IPC), with no staging buffer and no loop
on the host. Between two GPUs of a host it is a peer copy into the destination (peer_copy.py: copy engines
or the same kernel reading the other GPU's memory). Where either side is a tensor-parallel engine's shards, each
shard's heads go straight to the other side's (head_copy.py: copy engines). On CPU caches it is the torch reference below.
"""
from __future__ import annotations

from typing import Sequence

import torch

from common.kv.blocks import pinned_ids
from common.kv.shards import KvShards


def copy_blocks_reference(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor,
                          dst_ids: Sequence[int]) -> None:
    src_index = torch.tensor(list(src_ids), dtype=torch.long, device=src.device)
    dst_index = torch.tensor(list(dst_ids), dtype=torch.long, device=dst.device)
    if dst.dtype.itemsize == 1:  # an FP8 cache: torch has no index_copy_ of float8, the same bytes as uint8 do
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    dst.index_copy_(2, dst_index, src.index_select(2, src_index).to(dst.device))


class BlockCopier:
    """copy_blocks between two fixed caches (an exporter's mapped cache and this engine's), with everything that
    does not change between calls worked out once (the kernel compiled for them included): a pull then pays for
    its block ids and one launch."""

    def __init__(self, src: torch.Tensor | KvShards, dst: torch.Tensor | KvShards):
        self.kernel = self.peer = None
        if isinstance(src, KvShards) or isinstance(dst, KvShards):  # a tensor-parallel side: each shard's heads
            from common.kv.transports.cuda_ipc.head_copy import HeadSliceCopier

            self.src, self.dst, self.peer = src, dst, HeadSliceCopier(src, dst)
            self.device = self.peer.device
            return
        if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:] or src.dtype != dst.dtype:
            raise ValueError(f"caches {tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} {dst.dtype} hold "
                             "different blocks")
        self.src, self.dst = src, dst
        block_bytes = src[0, 0, 0].numel() * src.element_size()
        self.device = src.device  # where the copy runs: its stream's GPU
        if src.is_cuda and dst.is_cuda and src.device != dst.device:
            from common.kv.transports.cuda_ipc.peer_copy import PeerBlockCopier

            self.peer = PeerBlockCopier(src, dst)
            self.device = self.peer.device
        elif (src.is_cuda and src.device == dst.device and src.is_contiguous() and dst.is_contiguous()
                and block_bytes % 4 == 0):
            from common.kv.transports.cuda_ipc import block_copy_triton

            self.kernel = block_copy_triton.CopyKernel(
                src.view(-1).view(torch.int32), dst.view(-1).view(torch.int32), src.shape[0] * 2, src.shape[2],
                dst.shape[2], block_bytes // 4)

    def __call__(self, src_ids: Sequence[int], dst_ids: Sequence[int], stream: torch.cuda.Stream | None = None,
                 upload: bool = False) -> torch.Tensor | None:
        """Enqueue the copy on `stream` (default: the current one; returns at once on a GPU). Returns what the
        kernel still reads: its block ids, in pinned host memory that it reads in place over the bus. Keep them until
        the copy has finished. With `upload`, the ids go up to the GPU on that stream first and nothing need be kept:
        that costs the kernel less time (benchmarks/kv_import_trace.py: 124 µs against 156) but the host two more
        calls into the driver, which a pull pays for more (230 µs against 205 end to end, 623 against 555 right
        after a prefill). None where nothing need be kept (uploaded, or the copy done already)."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
        if not len(src_ids):
            return None
        if self.peer is not None:
            return self.peer(src_ids, dst_ids, stream or torch.cuda.current_stream(self.device))
        if self.kernel is None:
            copy_blocks_reference(self.src, src_ids, self.dst, dst_ids)
            return None
        stream = stream or torch.cuda.current_stream(self.src.device)
        ids = pinned_ids(src_ids, dst_ids)
        if upload:
            with torch.cuda.stream(stream):  # the upload keeps the pinned block until it has run
                self.kernel(ids.to(self.src.device, non_blocking=True), len(src_ids), stream)
            return None
        self.kernel(ids, len(src_ids), stream)
        return ids


def compile_for(cache: torch.Tensor) -> None:
    """Compile the copy kernel into caches of `cache`'s block shape now, as a worker starts: Triton compiles a
    kernel at its first launch (about half a second), which would otherwise fall on the first pull's critical path.
    Every cache of that block shape shares the compiled kernel, whatever its block count."""
    if not cache.is_cuda:
        return
    one_block = torch.zeros((1, 2, 1, *cache.shape[3:]), dtype=cache.dtype, device=cache.device)
    with torch.cuda.device(cache.device):
        copy_blocks(one_block, [0], torch.empty_like(one_block), [0])
        torch.cuda.current_stream().synchronize()


def copy_blocks(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor, dst_ids: Sequence[int]) -> None:
    """Enqueue the copy on the current stream (returns at once on a GPU); nothing need be kept alive for it. Caches of
    one GPU or the host: a peer copy's ids stay in pinned memory its kernel reads, so it goes through BlockCopier."""
    copier = BlockCopier(src, dst)
    if copier.peer is not None:
        raise ValueError(f"copy_blocks copies within one GPU; {src.device} -> {dst.device} takes a BlockCopier")
    copier(src_ids, dst_ids, upload=True)

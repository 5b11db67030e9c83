"""One-hop block copies where either cache is a tensor-parallel engine's shards (common.kv.shards.KvShards).

Each rank's shard holds a slice of the KV heads ([layers, 2, blocks, block_size, heads/n, head_dim]). The copy
goes from every exporter shard straight into the heads of every importer shard it overlaps: for each such pair and
each run of blocks consecutive on both sides, one cudaMemcpy3DPeerAsync (a width of the pair's heads, a height of
the run's token rows, a depth of every layer's K and V). The GPUs' copy engines move it; no SM is taken, and there is
no gather into a staging cache on the way (the torch path gathers every shard onto one GPU, then scatters).
Within one GPU and between GPUs of a host alike: pointers of another process's cache mapped through CUDA IPC are
named with the device that mapped them.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import torch

from common.kv.shards import HEAD_DIM, KvShards
from common.kv.blocks import runs
from common.kv.transports.cuda_ipc.peer_copy import check, cudart, enable_peer_access


class _Pos(ctypes.Structure):
    _fields_ = [("x", ctypes.c_size_t), ("y", ctypes.c_size_t), ("z", ctypes.c_size_t)]


class _PitchedPtr(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("pitch", ctypes.c_size_t), ("xsize", ctypes.c_size_t),
                ("ysize", ctypes.c_size_t)]


class _Extent(ctypes.Structure):
    _fields_ = [("width", ctypes.c_size_t), ("height", ctypes.c_size_t), ("depth", ctypes.c_size_t)]


class _Peer3DParms(ctypes.Structure):  # cudaMemcpy3DPeerParms
    _fields_ = [("srcArray", ctypes.c_void_p), ("srcPos", _Pos), ("srcPtr", _PitchedPtr), ("srcDevice", ctypes.c_int),
                ("dstArray", ctypes.c_void_p), ("dstPos", _Pos), ("dstPtr", _PitchedPtr), ("dstDevice", ctypes.c_int),
                ("extent", _Extent)]


def _shards(cache: torch.Tensor | KvShards) -> list[tuple[int, torch.Tensor]]:
    """(first head, tensor) of each part of a cache: a plain tensor is one part holding every head."""
    if isinstance(cache, KvShards):
        return [(heads.start, shard) for heads, shard in cache.head_slices()]
    return [(0, cache)]


@dataclass(frozen=True)
class HeadPiece:
    """Heads [src_head, src_head + heads) of `src` go to [dst_head, dst_head + heads) of `dst`."""
    src: torch.Tensor
    src_head: int
    dst: torch.Tensor
    dst_head: int
    heads: int


def pieces(src: torch.Tensor | KvShards, dst: torch.Tensor | KvShards) -> list[HeadPiece]:
    """Every (exporter part, importer part) pair whose heads overlap, with the overlap in each part's own heads."""
    out = []
    for src_first, s in _shards(src):
        for dst_first, d in _shards(dst):
            low = max(src_first, dst_first)
            high = min(src_first + s.shape[HEAD_DIM], dst_first + d.shape[HEAD_DIM])
            if low < high:
                out.append(HeadPiece(s, low - src_first, d, low - dst_first, high - low))
    return out


def same_blocks(src: torch.Tensor | KvShards, dst: torch.Tensor | KvShards) -> bool:
    """Whether the two caches hold the same blocks, whatever the head split of each: layers, block size, head
    size, the total of heads and the dtype."""
    return (src.shape[:2] == dst.shape[:2] and src.shape[3:] == dst.shape[3:] and src.dtype == dst.dtype)


class HeadSliceCopier:
    """dst[:, :, dst_ids] = src[:, :, src_ids] (every head) where either side is KvShards: shaped like
    block_copy.BlockCopier (`device`, `src`, `dst`, a call that enqueues on a stream and returns at once)."""

    def __init__(self, src: torch.Tensor | KvShards, dst: torch.Tensor | KvShards):
        if not same_blocks(src, dst):
            raise ValueError(f"caches {tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} {dst.dtype} hold "
                             "different blocks")
        self.src, self.dst = src, dst
        self.pieces = pieces(src, dst)
        for p in self.pieces:
            if not (p.src.is_cuda and p.dst.is_cuda and p.src.is_contiguous() and p.dst.is_contiguous()):
                raise ValueError("a head-slice copy needs contiguous GPU caches")
            for a, b in ((p.dst.device, p.src.device), (p.src.device, p.dst.device)):
                if not enable_peer_access(a, b):
                    raise RuntimeError(f"{a} cannot reach {b}'s memory (no peer access between them)")
        first = _shards(dst)[0][1]
        self.device = first.device  # the stream's GPU: the importer's first (copy engines serve any pair)
        self.planes = src.shape[0] * 2
        self.block_size = src.shape[3]
        self.head_bytes = src.shape[HEAD_DIM + 1] * src.element_size()

    def __call__(self, src_ids: Sequence[int], dst_ids: Sequence[int], stream: torch.cuda.Stream) -> None:
        """Enqueue the copy on `stream` (a stream of `self.device`); returns at once, nothing need be kept."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
        spans = runs(src_ids, dst_ids)
        lib, bs, hb = cudart(), self.block_size, self.head_bytes
        with torch.cuda.device(stream.device):
            for p in self.pieces:
                src_pitch, dst_pitch = p.src.shape[HEAD_DIM] * hb, p.dst.shape[HEAD_DIM] * hb
                for s, d, n in spans:
                    parms = _Peer3DParms(
                        srcPos=_Pos(p.src_head * hb, s * bs, 0),
                        srcPtr=_PitchedPtr(p.src.data_ptr(), src_pitch, src_pitch, p.src.shape[2] * bs),
                        srcDevice=p.src.device.index,
                        dstPos=_Pos(p.dst_head * hb, d * bs, 0),
                        dstPtr=_PitchedPtr(p.dst.data_ptr(), dst_pitch, dst_pitch, p.dst.shape[2] * bs),
                        dstDevice=p.dst.device.index,
                        extent=_Extent(p.heads * hb, n * bs, self.planes))
                    check(lib.cudaMemcpy3DPeerAsync(ctypes.byref(parms), ctypes.c_void_p(stream.cuda_stream)),
                           "cudaMemcpy3DPeerAsync")

"""Block copies between the caches of two GPUs of one host (over NVLink, or PCIe where there is none).

Three ways, one interface (PeerBlockCopier, shaped like block_copy.BlockCopier):
- `dst`: the block-copy kernel on the importer's GPU, reading the exporter's memory (peer reads),
- `src`: the same kernel on the exporter's GPU, writing the importer's (peer writes),
- `copy_engine`: one cudaMemcpy2DAsync per run of consecutive blocks, every layer's K and V of the run in one
  strided copy: the GPUs' copy engines move it, no SM of either GPU is taken from the model's steps.
- `auto` (the default): copy engines where the session's blocks make few runs, else the kernel on theirs.
  Not the kernel on ours: the exporter's cache is mapped through CUDA IPC in the context of the exporter's GPU,
  and a launch on ours is refused ("Pointer argument (at 0) cannot be accessed from Triton"); our own cache is
  an ordinary peer allocation, which a launch on theirs reaches. It takes the exporter's SMs for the copy's
  half millisecond, at the data plane's high stream priority.
Why `auto` chooses so (benchmarks/kv_peer_copy.py measures the three): over consecutive blocks the copy engines
match one contiguous peer copy of the session's bytes and the kernels come close; over scattered blocks each run is a
2-D copy of its own, and the copy engines take more than twice the kernels' time, which stays the same. The torch
path (gather, copy, scatter) takes about twice either. Copy engines leave both GPUs' SMs alone. The block pools hand
out runs of consecutive ids (common.engine.block_manager), so a session is a few runs on both sides
(benchmarks/block_runs.py counts them), and MAX_COPY_ENGINE_RUNS bounds where copy engines still win.
Peer access between the two GPUs must be on for all three: enable_peer_access (the caches may be another
process's, mapped through CUDA IPC).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
from functools import lru_cache
from typing import Sequence

import torch

from common.kv.blocks import pinned_ids, runs

_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyKind: the direction from the pointers (unified addressing)
_PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
MAX_COPY_ENGINE_RUNS = 8  # past this many 2-D copies the host's calls and the engines' setup cost more than a kernel
_enabled: set[tuple[int, int]] = set()
_enabled_lock = threading.Lock()


@lru_cache(maxsize=1)
def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (the same library, so the same contexts and streams)."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart" in line:
                return ctypes.CDLL(line.split()[-1])
    name = ctypes.util.find_library("cudart")
    if name is None:
        raise RuntimeError("the CUDA runtime library (libcudart) is not loaded in this process")
    return ctypes.CDLL(name)


def check(code: int, what: str) -> None:
    if code:
        lib = cudart()
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetLastError()  # clear it, or the next launch in this thread reports it again
        raise RuntimeError(f"{what} failed: {lib.cudaGetErrorString(code).decode()} ({code})")


def enable_peer_access(device: torch.device, peer: torch.device) -> bool:
    """Let kernels and copies on `device` reach `peer`'s memory; False where the hardware cannot (once a pair)."""
    a, b = device.index, peer.index
    if a == b:
        return True
    with _enabled_lock:
        if (a, b) in _enabled:
            return True
        if not torch.cuda.can_device_access_peer(a, b):
            return False
        with torch.cuda.device(a):
            code = cudart().cudaDeviceEnablePeerAccess(ctypes.c_int(b), ctypes.c_uint(0))
        if code == _PEER_ACCESS_ALREADY_ENABLED:
            cudart().cudaGetLastError()
        elif code:
            check(code, f"cudaDeviceEnablePeerAccess(cuda:{a} -> cuda:{b})")
        _enabled.add((a, b))
        return True


def can_reach(device: torch.device, peer: torch.device) -> bool:
    """Whether a copy between the two GPUs' memories can run (the same GPU, or peer access both ways)."""
    if device == peer:
        return True
    if device.type != "cuda" or peer.type != "cuda":
        return False
    return torch.cuda.can_device_access_peer(device.index, peer.index) and \
        torch.cuda.can_device_access_peer(peer.index, device.index)

class PeerBlockCopier:
    """dst[:, :, dst_ids] = src[:, :, src_ids] between caches on two GPUs, by `on` (see the module doc)."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, on: str = "auto"):
        if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:] or src.dtype != dst.dtype:
            raise ValueError(f"caches {tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} {dst.dtype} hold "
                             "different blocks")
        if not (src.is_cuda and dst.is_cuda and src.is_contiguous() and dst.is_contiguous()):
            raise ValueError("a peer copy needs two contiguous GPU caches")
        if on not in ("dst", "src", "copy_engine", "auto"):
            raise ValueError(f"unknown peer copy {on!r}")
        for a, b in ((dst.device, src.device), (src.device, dst.device)):
            if not enable_peer_access(a, b):
                raise RuntimeError(f"{a} cannot reach {b}'s memory (no peer access between them)")
        self.src, self.dst, self.on = src, dst, on
        self.planes = src.shape[0] * 2
        self.block_bytes = src[0, 0, 0].numel() * src.element_size()
        self.kernel = None
        if on != "copy_engine":  # auto too: its kernel for scattered blocks
            from common.kv.transports.cuda_ipc import block_copy_triton

            self.kernel = block_copy_triton.CopyKernel(
                src.view(-1).view(torch.int32), dst.view(-1).view(torch.int32), self.planes, src.shape[2],
                dst.shape[2], self.block_bytes // 4)

    @property
    def device(self) -> torch.device:
        """The GPU whose stream the copy goes on (copy engines: ours; `auto` takes the kernel's, theirs)."""
        return self.dst.device if self.on in ("dst", "copy_engine") else self.src.device


    def __call__(self, src_ids: Sequence[int], dst_ids: Sequence[int],
                 stream: torch.cuda.Stream) -> torch.Tensor | None:
        """Enqueue the copy on `stream` (a stream of `self.device`); returns at once. What it returns (the kernel's
        pinned block ids) must be kept until the copy has finished."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
        if not len(src_ids):
            return None
        spans = runs(src_ids, dst_ids) if self.on in ("copy_engine", "auto") else []
        if self.kernel is not None and (self.on != "auto" or len(spans) > MAX_COPY_ENGINE_RUNS):
            # a launch goes to the stream's GPU: theirs for `src` and `auto`, ours for `dst`
            ids = pinned_ids(src_ids, dst_ids)
            self.kernel(ids, len(src_ids), stream)
            return ids
        lib, bb = cudart(), self.block_bytes
        spitch, dpitch = self.src.shape[2] * bb, self.dst.shape[2] * bb
        src_base, dst_base = self.src.data_ptr(), self.dst.data_ptr()
        with torch.cuda.device(stream.device):
            for s, d, n in spans:
                check(lib.cudaMemcpy2DAsync(
                    ctypes.c_void_p(dst_base + d * bb), ctypes.c_size_t(dpitch), ctypes.c_void_p(src_base + s * bb),
                    ctypes.c_size_t(spitch), ctypes.c_size_t(n * bb), ctypes.c_size_t(self.planes),
                    ctypes.c_int(_CUDA_MEMCPY_DEFAULT), ctypes.c_void_p(stream.cuda_stream)), "cudaMemcpy2DAsync")
        return None

"""The CPU's paged decode attention kernel (cpu_attention.c), built and loaded by cpu_build.py. Where it cannot be
built, `kernel()` is None and TorchPagedAttention gathers the blocks and calls SDPA instead (the same answer,
slower: README "The CPU path")."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from common.engine.cpu_build import library

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # of q and out
_CACHE_DTYPES = {**_DTYPES, torch.float8_e4m3fn: 2}  # of the caches: the compute dtype, or FP8 (read times a scale)


@cache
def kernel():
    """The compiled kernel's function, or None where it cannot be built (no C compiler, or DISAGG_CPU_KERNELS=0)."""
    built = library("cpu_attention.c")
    if built is None:
        return None
    function = built.paged_decode_attention
    function.restype = ctypes.c_int
    function.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7
                         + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_float])
    return function


def applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The kernel's cases: CPU tensors of float32 or bf16, the caches of the same dtype or FP8 (an FP8 KV cache),
    each cache block [block_size, Hkv, D] contiguous (a tensor-parallel rank's slice of the heads is not), one torch
    thread (the kernel runs on one core; with more, torch's SDPA spreads over them) and the kernel built."""
    n, block_size, heads, dim = k_cache.shape
    return (q.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
            and k_cache.stride()[1:] == (heads * dim, dim, 1) and torch.get_num_threads() == 1
            and kernel() is not None)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
           seq_lens: torch.Tensor, starts: torch.Tensor, scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """q [B, Hq, D]; caches [N, block_size, Hkv, D]; block_ids [B * max_blocks] int64, each sequence's blocks;
    attends to tokens [starts[b], seq_lens[b]) of sequence b → [B, Hq, D] (check `applies` first). An FP8
    cache's values are read times `kv_scale`."""
    q = q.contiguous()
    out = torch.empty_like(q)
    batch, heads, dim = q.shape
    status = kernel()(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), block_ids.data_ptr(),
                      seq_lens.data_ptr(), starts.data_ptr(), batch, block_ids.numel() // max(batch, 1),
                      k_cache.shape[1], heads, k_cache.shape[2], dim, k_cache.stride(0), scale, _DTYPES[q.dtype],
                      _CACHE_DTYPES[k_cache.dtype], kv_scale)
    if status:
        raise MemoryError("the CPU attention kernel could not allocate its workspace")
    return out

"""The CPU's paged attention kernels (cpu_attention.c: decode, and prefill chunks over their cached context), built
and loaded by cpu_build.py. Where they cannot be built, `kernel()` is None and TorchPagedAttention gathers the blocks
and calls SDPA instead (the same answer, slower: docs/benchmarks/vllm_cpu.md)."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from common.engine.cpu_build import library

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # of q and out
_CACHE_DTYPES = {**_DTYPES, torch.float8_e4m3fn: 2}  # of the caches: the compute dtype, or FP8 (read times a scale)


def _function(name: str, argtypes: list) -> ctypes._CFuncPtr | None:
    """cpu_attention.c's function `name`, typed, or None where the kernels cannot be built."""
    built = library("cpu_attention.c")
    if built is None:
        return None
    function = getattr(built, name)
    function.restype = ctypes.c_int
    function.argtypes = argtypes
    return function


@cache
def kernel():
    """The compiled decode kernel's function, or None where it cannot be built (no C compiler)."""
    return _function("paged_decode_attention", [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7
                     + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_float])


@cache
def prefill_kernel():
    """The compiled prefill kernel's function, or None where the kernels cannot be built."""
    return _function("paged_prefill_attention", [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 7
                     + [ctypes.c_float, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_float])


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


def prefill_applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The prefill kernel's cases: the decode kernel's (`applies`); a name of its own so that a bench or test can
    turn prefills alone back to the torch path."""
    return applies(q, k_cache)


def prefill(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
            rows: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor, scale: float,
            window: int | None, kv_scale: float = 1.0) -> None:
    """Writes out[rows[s] : rows[s] + query_lens[s]] for each prefill sequence s: its query tokens (positions
    context_lens[s] onwards) attend causally, within `window` if set, to the sequence's tokens in the caches, their
    own included. q and out [T, Hq, D] contiguous; block_ids [S * max_blocks] int64, each sequence's blocks; the
    other index tensors [S] int64 (check `prefill_applies` first)."""
    sequences, (_, heads, dim) = rows.numel(), q.shape
    status = prefill_kernel()(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                              block_ids.data_ptr(), rows.data_ptr(), query_lens.data_ptr(), context_lens.data_ptr(),
                              sequences, block_ids.numel() // max(sequences, 1), k_cache.shape[1], heads,
                              k_cache.shape[2], dim, k_cache.stride(0), scale, window or 0, _DTYPES[q.dtype],
                              _CACHE_DTYPES[k_cache.dtype], kv_scale)
    if status:
        raise MemoryError("the CPU attention kernel could not allocate its workspace")

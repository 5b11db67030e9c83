"""The decoder layer's small bf16 ops on the CPU as C kernels (cpu_ops.c, built and loaded by cpu_build.py): add +
RMSNorm, RoPE + the K/V cache write, SiLU * up, each one pass over its rows where torch runs several ops.

They run where the C decode attention does (cpu_attention.applies): bf16 CPU tensors, one torch thread (a worker
on a core of its own; with more threads torch's ops spread over them), the library built. Float32 keeps torch's
ops, the arithmetic of the Hugging Face reference that greedy float32 output must equal token for token.
"""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from common.engine.cpu_build import library

_MAX_HEAD_DIM = 512  # cpu_ops.c's MAX_HEAD_DIM


@cache
def _lib() -> ctypes.CDLL | None:
    built = library("cpu_ops.c")
    if built is None:
        return None
    built.add_rms_norm_bf16.restype = ctypes.c_int
    built.add_rms_norm_bf16.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    built.rope_store_kv_bf16.restype = None
    built.rope_store_kv_bf16.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 6
                                         + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2 + [ctypes.c_float] * 2)
    built.silu_and_mul_bf16.restype = None
    built.silu_and_mul_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    return built


def warm() -> None:
    """Build (once per machine: about half a second) or load the kernels now, not in a bf16 worker's first step."""
    _lib()


def applies(x: torch.Tensor) -> bool:
    """Whether the kernels take `x`: a bf16 CPU tensor, one torch thread, the library built."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and torch.get_num_threads() == 1 and _lib() is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous rows; a step's [T, hidden] as it is (a reshape and a view cost about as much as a kernel)."""
    return x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()


def _shaped(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return out if out.dim() == like.dim() else out.view(*like.shape[:-1], out.shape[-1])


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) as reference.add_rms_norm; without a residual, (rms_norm(x), x).
    weight: bf16 [hidden] (check `norm_applies`)."""
    rows = _rows(x)
    res = None if residual is None else _rows(residual)
    out = torch.empty_like(rows)
    total = rows if res is None else torch.empty_like(rows)
    status = _lib().add_rms_norm_bf16(rows.data_ptr(), _pointer(res), weight.data_ptr(), out.data_ptr(),
                                      None if res is None else total.data_ptr(), rows.shape[0], rows.shape[1], eps)
    if status:
        raise MemoryError("the CPU RMSNorm kernel could not allocate its row")
    return _shaped(out, x), (x if res is None else _shaped(total, x))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = gate ‖ up → silu(gate) * up [..., I], as reference.silu_and_mul (check `applies`)."""
    rows = _rows(x)
    inter = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], inter), dtype=x.dtype)
    _lib().silu_and_mul_bf16(rows.data_ptr(), out.data_ptr(), rows.shape[0], inter)
    return _shaped(out, x)


def norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return applies(x) and _bf16_block(weight) and weight.numel() == x.shape[-1]


def rope_store_applies(x: torch.Tensor, k_cache: torch.Tensor, cos_sin: torch.Tensor | None = None,
                       norms: tuple[tuple[torch.Tensor, float] | None, ...] = ()) -> bool:
    """Whether `rope_store_kv` takes a step of `x` (bf16, see `applies`) into the caches [N, bs, Hkv, D] (K's and V's
    alike, as a layer's two halves are): the cache of the same dtype (an FP8 cache keeps the torch write) and contiguous (a tensor-parallel rank's slice of the heads
    is not), D even and at most 512; cos_sin, when given, and the per-head norms' weights bf16 and contiguous."""
    dim = k_cache.shape[-1]
    return (applies(x) and k_cache.dtype == x.dtype and k_cache.is_contiguous() and dim % 2 == 0
            and dim <= _MAX_HEAD_DIM and (cos_sin is None or _bf16_block(cos_sin))
            and all(n is None or _bf16_block(n[0]) for n in norms))


def _bf16_block(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and t.is_contiguous()


def rope_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  q_norm: tuple[torch.Tensor, float] | None = None,
                  k_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """reference.rope_store_kv in one pass (check `rope_store_applies`): q [T, Hq, D] roped; K roped and V written
    at `slots` of the caches (slot < 0: not written). q_norm / k_norm: (weight [D], eps) of Qwen3, or None."""
    tokens, norms = qkv.shape[0], (q_norm, k_norm)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if positions.dtype != torch.int64 or slots.dtype != torch.int64:  # the engine's are: each .to costs ~1 us
        positions, slots = positions.to(torch.int64), slots.to(torch.int64)
    positions, slots = positions.contiguous(), slots.contiguous()
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype)
    _lib().rope_store_kv_bf16(qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos_sin.data_ptr(), q.data_ptr(),
                              k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), tokens, num_heads,
                              num_kv_heads, head_dim,
                              *(None if n is None else n[0].data_ptr() for n in norms),
                              *(0.0 if n is None else n[1] for n in norms))
    return q

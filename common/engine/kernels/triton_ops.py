"""Triton kernels of the decoder layer (CUDA only; reference.py holds the torch version of each).

Each rounds to the model dtype where Hugging Face's arithmetic does, so a bf16 step agrees with the
reference to within rounding of a different summation order, and an fp32 step to float32 precision.
Importing this module needs triton: `common.engine.kernels` does so only for CUDA tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x (float32) rounded to the model dtype, back as float32: the rounding torch does between two ops."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, eps, stride_x, stride_r, stride_o, stride_ro,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = _round(x + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(res_out_ptr + row * stride_ro + offs, x.to(dtype), mask=mask)
    var = tl.sum(x * x, axis=0) / n
    y = _round(x * tl.rsqrt(var + eps), dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    n = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else x2
    block = triton.next_power_of_2(n)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, res2, weight, out, res_out, n, eps, x2.stride(0), res2.stride(0),
                                         out.stride(0), res_out.stride(0), HAS_RES=residual is not None,
                                         BLOCK=block, num_warps=_warps(block))
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(x, residual, weight, eps)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x2 = _rows(x)
    inter = x2.shape[-1] // 2
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, SILU_BLOCK))](x2, out, inter, x2.stride(0),
                                                                            out.stride(0), BLOCK=SILU_BLOCK)
    return out.view(*x.shape[:-1], inter)


@triton.jit
def _head_norm(x1, x2, w_ptr, i, m, eps, D: tl.constexpr, dtype: tl.constexpr):
    """Qwen3's per-head RMSNorm of one head, given as its two halves."""
    var = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D
    r = tl.rsqrt(var + eps)
    w1 = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + D // 2 + i, mask=m, other=0.0).to(tl.float32)
    return _round(w1 * _round(x1 * r, dtype), dtype), _round(w2 * _round(x2 * r, dtype), dtype)


@triton.jit
def _rotate(x1, x2, c, s, dtype: tl.constexpr):
    """HF's x * cos + rotate_half(x) * sin, each product rounded to the dtype as torch does."""
    o1 = _round(x1 * c, dtype) - _round(x2 * s, dtype)
    o2 = _round(x2 * c, dtype) + _round(x1 * s, dtype)
    return o1, o2


@triton.jit
def _rope_store_kv_kernel(qkv_ptr, q_out, positions, cos_sin, q_norm_w, k_norm_w, k_cache, v_cache, slots,
                          q_eps, k_eps, stride_qkv, stride_cs, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                          D: tl.constexpr, HALF_PAD: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF_PAD)
    m = i < HALF
    dtype = qkv_ptr.dtype.element_ty
    pos = tl.load(positions + t).to(tl.int64)
    c = tl.load(cos_sin + pos * stride_cs + i, mask=m, other=0.0).to(tl.float32)
    s = tl.load(cos_sin + pos * stride_cs + HALF + i, mask=m, other=0.0).to(tl.float32)
    row = qkv_ptr + t * stride_qkv
    if h < NUM_HEADS:
        x1 = tl.load(row + h * D + i, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(row + h * D + HALF + i, mask=m, other=0.0).to(tl.float32)
        if Q_NORM:
            x1, x2 = _head_norm(x1, x2, q_norm_w, i, m, q_eps, D, dtype)
        o1, o2 = _rotate(x1, x2, c, s, dtype)
        dst = q_out + (t * NUM_HEADS + h) * D
        tl.store(dst + i, o1.to(dtype), mask=m)
        tl.store(dst + HALF + i, o2.to(dtype), mask=m)
    else:
        kh = h - NUM_HEADS
        slot = tl.load(slots + t)
        if slot >= 0:  # slot < 0: a padded row of a CUDA graph, nothing to store
            src = row + (NUM_HEADS + kh) * D
            x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
            if K_NORM:
                x1, x2 = _head_norm(x1, x2, k_norm_w, i, m, k_eps, D, dtype)
            o1, o2 = _rotate(x1, x2, c, s, dtype)
            dst = slot * (NUM_KV_HEADS * D) + kh * D
            cache_dtype = k_cache.dtype.element_ty
            tl.store(k_cache + dst + i, o1.to(cache_dtype), mask=m)
            tl.store(k_cache + dst + HALF + i, o2.to(cache_dtype), mask=m)
            vsrc = row + (NUM_HEADS + NUM_KV_HEADS + kh) * D
            tl.store(v_cache + dst + i, tl.load(vsrc + i, mask=m, other=0.0).to(cache_dtype), mask=m)
            tl.store(v_cache + dst + HALF + i, tl.load(vsrc + HALF + i, mask=m, other=0.0).to(cache_dtype), mask=m)


def rope_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  q_norm: tuple[torch.Tensor, float] | None = None,
                  k_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    T = qkv.shape[0]
    q = torch.empty((T, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q_w, q_eps = q_norm if q_norm is not None else (qkv, 0.0)  # any pointer: unread without the norm
    k_w, k_eps = k_norm if k_norm is not None else (qkv, 0.0)
    _rope_store_kv_kernel[(T, num_heads + num_kv_heads)](
        qkv, q, positions, cos_sin, q_w, k_w, k_cache, v_cache, slots, q_eps, k_eps, qkv.stride(0),
        cos_sin.stride(0), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, D=head_dim,
        HALF_PAD=triton.next_power_of_2(head_dim // 2), Q_NORM=q_norm is not None, K_NORM=k_norm is not None,
        num_warps=1)
    return q

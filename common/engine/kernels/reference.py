"""The torch reference of every fused kernel: what runs on the CPU, and what the GPU tests compare against.

Each follows Hugging Face's arithmetic step by step (and its rounding to the model dtype between steps),
so the engine's CPU path gives HF's tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add rounded to the dtype first, as HF's."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = gate ‖ up → silu(gate) * up [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D/2] (HF's rotate_half convention: pairs (i, i + D/2))."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = torch.cat((cos, cos), -1)[:, None, :], torch.cat((sin, sin), -1)[:, None, :]
    return x * c + torch.cat((-x2, x1), dim=-1) * s


def rope_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  q_norm: tuple[torch.Tensor, float] | None = None,
                  k_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """Split qkv [T, (Hq + 2 Hkv) D]; per-head norms (Qwen3) then RoPE on q and k; K and V written at their
    cache slots (slot < 0: not written). Returns q [T, Hq, D]. cos_sin [max_pos, D] = cos ‖ sin halves."""
    T = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(T, num_heads, head_dim)
    k = k.reshape(T, num_kv_heads, head_dim)
    v = v.reshape(T, num_kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm(q, *q_norm)
    if k_norm is not None:
        k = rms_norm(k, *k_norm)
    cs = cos_sin[positions]
    cos, sin = cs.chunk(2, dim=-1)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    keep = slots >= 0
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    flat_k[slots[keep]] = k[keep].to(k_cache.dtype)
    flat_v[slots[keep]] = v[keep].to(v_cache.dtype)
    return q

"""Fused kernels of the decoder layer: Triton on CUDA, the torch reference (reference.py) everywhere else.

- `rms_norm`, `add_rms_norm`: RMSNorm, with the residual add fused in (one pass over the row);
- `silu_and_mul`: the MLP's activation over the fused gate ‖ up output;
- `rope_store_kv`: per-head q/k norms (Qwen3), RoPE, and the K/V cache write in one kernel;
- `norm_linear`, `silu_linear`, `linear`: a linear layer with the op before it; at one row on CUDA a Triton
  GEMV with that op fused in (gemv.py), where it measured no slower, inside a CUDA graph, than the op's own
  kernel followed by cuBLAS, for the weight's shape.
A Triton kernel is used only for CUDA tensors with triton installed, so the CPU path never imports it. On the CPU,
norms, SiLU * up and RoPE + the K/V write run as C kernels (cpu_ops.py) for bf16 on one torch thread.
"""
from __future__ import annotations

import importlib.util
from functools import cache

import torch
from torch import nn

from common.engine import cpu_ops
from common.engine.kernels import reference

HAS_TRITON = importlib.util.find_spec("triton") is not None


@cache
def _triton():
    from common.engine.kernels import triton_ops

    return triton_ops


@cache
def _gemv():
    from common.engine.kernels import gemv

    return gemv


def _gemv_scale(layer: nn.Module) -> torch.Tensor | None:
    """What the GEMV multiplies a layer's rows by: nothing for a plain linear, an Fp8Linear's row scales."""
    return getattr(layer, "weight_scale", None)


def _gemv_applies(x: torch.Tensor, layer: nn.Module, prologue: str | None = None) -> bool:
    """A plain linear, or an Fp8Linear where its FP8 GEMM would run (one scale a row, bf16, a GPU with FP8: the
    GEMV's float8 loads need one), at one row on CUDA, where the GEMV measured no slower."""
    if not (_on_gpu(x) and x.dim() == 2 and x.shape[0] == 1):
        return False
    fp8_gemm_applies = getattr(layer, "fp8_gemm_applies", None)
    if not (isinstance(layer, nn.Linear) or (fp8_gemm_applies is not None and fp8_gemm_applies(x))):
        return False
    return _gemv().applies(x, layer.weight, layer.bias, prologue, _gemv_scale(layer))


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda and HAS_TRITON


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _on_gpu(x):
        return _triton().rms_norm(x, weight, eps)
    if cpu_ops.norm_applies(x, weight):
        return cpu_ops.add_rms_norm(x, None, weight, eps)[0]
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    if _on_gpu(x):
        return _triton().add_rms_norm(x, residual, weight, eps)
    if cpu_ops.norm_applies(x, weight) and residual.dtype == x.dtype:
        return cpu_ops.add_rms_norm(x, residual, weight, eps)
    return reference.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _on_gpu(x):
        return _triton().silu_and_mul(x)
    if cpu_ops.applies(x):
        return cpu_ops.silu_and_mul(x)
    return reference.silu_and_mul(x)


def rope_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  q_norm: nn.Module | None = None, k_norm: nn.Module | None = None) -> torch.Tensor:
    """q [T, Hq, D] after norm + RoPE; K (normed, roped) and V written at `slots` of the caches [N, bs, Hkv, D].
    q_norm / k_norm: the RMSNorm modules of Qwen3 (weight [D], eps), or None."""
    norms = tuple(None if m is None else (m.weight, m.eps) for m in (q_norm, k_norm))
    if _on_gpu(qkv):
        impl = _triton()
    else:
        impl = cpu_ops if cpu_ops.rope_store_applies(qkv, k_cache, cos_sin, norms) else reference
    return impl.rope_store_kv(qkv, positions, cos_sin, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim,
                              *norms)


def rope_store_on_cpu(x: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether a step of `x` ropes q and k and writes K/V with `rope_store_kv` where the backend would write them
    itself (TorchPagedAttention): on the CPU, where the C kernel takes the step (bf16, the cache's dtype)."""
    return cpu_ops.rope_store_applies(x, k_cache)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module,
                layer: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer(norm(x + residual)), x + residual); without a residual, (layer(norm(x)), x)."""
    if residual is not None and _gemv_applies(x, layer, "add_norm"):
        return _gemv().gemv(x, layer.weight, layer.bias, "add_norm", residual, (norm.weight, norm.eps),
                            scale=_gemv_scale(layer))
    if residual is None:
        return linear(rms_norm(x, norm.weight, norm.eps), layer), x
    h, residual = add_rms_norm(x, residual, norm.weight, norm.eps)
    return linear(h, layer), residual


def silu_linear(gate_up: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """layer(silu(gate) · up) of gate_up = gate ‖ up."""
    if _gemv_applies(gate_up, layer, "silu_mul"):
        return _gemv().gemv(gate_up, layer.weight, layer.bias, "silu_mul", scale=_gemv_scale(layer))
    return layer(silu_and_mul(gate_up))


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    if _gemv_applies(x, layer):
        return _gemv().gemv(x, layer.weight, layer.bias, scale=_gemv_scale(layer))
    return layer(x)

"""A linear layer with FP8 weights: float8_e4m3fn [out, in] and float32 scales, one per row and block of columns.

Every checkpoint format is held in one form (fp8_checkpoint.py turns each into it): `weight_scale` [out, n_blocks]
multiplies row r's columns [j * block_k, (j + 1) * block_k); per-tensor and per-channel scales are one column
(block_k None: the whole row), DeepSeek's 128x128 blocks repeat their scale over the block's 128 rows. Row-wise
scales let a fused projection (q ‖ k ‖ v) concatenate its parts' scales as it concatenates their rows.

Where it runs:
- CUDA, compute capability >= 8.9 (Ada, Hopper), bf16 activations, one scale a row: `torch._scaled_mm`, an FP8
  GEMM, each token's activations quantised with its own dynamic scale (absmax / 448) by one Triton kernel
  (fp8_triton.py). At one token a step, the batch-1 GEMV (common/engine/kernels/gemv.py) reads the FP8 rows with
  their scales instead, where it measures faster (kernels.linear and its fused variants choose).
- other GPUs, other dtypes, block-wise scales: the weight is dequantised to the compute dtype on each call
  (float32 product, then cast) and multiplied in that dtype: FP8 in memory, a conversion per call. Unmeasured.
- the CPU holds no Fp8Linear: the loader dequantises FP8 weights once, by the same rule, into plain linear layers
  (fp8_checkpoint.holds_fp8 says why). The CPU tests run this module's two paths on the CPU directly.
"""
from __future__ import annotations

import importlib.util
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = 1e-12  # an all-zero row or token: any positive scale gives zeros
# kernels.HAS_TRITON's check, not imported from there: kernels.gemv times its FP8 GEMV against scaled_mm_linear
HAS_TRITON = importlib.util.find_spec("triton") is not None


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale [out, 1]): each row scaled so its largest magnitude is FP8's largest value."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block_k: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype`: FP8 values times their row's (block's) scale, in float32, then cast."""
    if block_k is not None:
        scale = scale.repeat_interleave(block_k, dim=1)[:, : weight.shape[1]]
    return (weight.float() * scale).to(dtype)


def gemm_dims_fit(out_features: int, in_features: int) -> bool:
    """_scaled_mm's row-wise scaling takes both GEMM dimensions in multiples of 16."""
    return out_features % 16 == 0 and in_features % 16 == 0


@cache
def _has_fp8_gemm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(nn.Module):
    """y = x W^T + b with W held as FP8 and its scales (module docstring); built on the meta device by the loader,
    which assigns the checkpoint's tensors."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scale_columns: int, block_k: int | None):
        super().__init__()
        self.in_features, self.out_features, self.block_k = in_features, out_features, block_k
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, scale_columns), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"scales={'per row' if self.block_k is None else f'per row and {self.block_k} columns'}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_gemm_applies(x):
            return self._fp8_gemm(x)
        return F.linear(x, dequantize(self.weight, self.weight_scale, self.block_k, x.dtype), self.bias)

    def fp8_gemm_applies(self, x: torch.Tensor) -> bool:
        # _scaled_mm's row-wise scaling: bf16 out, both GEMM dimensions multiples of 16.
        return (x.is_cuda and self.block_k is None and x.dtype == torch.bfloat16
                and gemm_dims_fit(self.out_features, self.in_features) and _has_fp8_gemm(x.device))

    def _fp8_gemm(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_mm_linear(x, self.weight, self.weight_scale, self.bias)


@cache
def _fused_quantize():
    """fp8_triton.quantize_tokens, imported once (it needs triton): quantize_tokens runs before every FP8 GEMM."""
    from common.engine.quantization.fp8_triton import quantize_tokens

    return quantize_tokens


def quantize_tokens(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 rows, float32 scale [M, 1]): each token (row) scaled so its largest magnitude is FP8's largest value;
    one Triton kernel on CUDA (fp8_triton.py), the same arithmetic in torch ops elsewhere."""
    if rows.is_cuda and HAS_TRITON and rows.stride(-1) == 1:
        return _fused_quantize()(rows, FP8, FP8_MAX, _MIN_SCALE)
    scale = (rows.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (rows.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b as an FP8 GEMM (torch._scaled_mm): x's tokens quantised each with its own scale, W [out, in] FP8
    with one scale a row ([out, 1]); the result in x's dtype."""
    rows = x.reshape(-1, weight.shape[1])
    x_fp8, x_scale = quantize_tokens(rows)
    out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])

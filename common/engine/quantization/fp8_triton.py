"""Each token's activations quantised to FP8 with its own scale (absmax / 448) in one Triton kernel (CUDA only;
importing this module needs triton): the torch ops it replaces were eight kernels before every FP8 GEMM, enough
launches to make a decode step in FP8 slower than in bf16 (benchmarks/fp8.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _quantize_tokens_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, fp8_max, min_scale, BLOCK: tl.constexpr):
    """Program r: row r's absmax over K in BLOCK chunks, then the row divided by its scale, saturated, as FP8."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    peak = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(x))
    scale = tl.maximum(tl.max(peak, axis=0) / fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)
        tl.store(q_ptr + row * K + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K)


def quantize_tokens(rows: torch.Tensor, fp8: torch.dtype, fp8_max: float, min_scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows as FP8 [M, K], float32 scales [M, 1]) of rows [M, K] (last dimension contiguous)."""
    m, k = rows.shape
    q = torch.empty((m, k), dtype=fp8, device=rows.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=rows.device)
    if m:
        _quantize_tokens_kernel[(m,)](rows, q, scale, k, rows.stride(0), fp8_max, min_scale,
                                      BLOCK=min(_BLOCK, triton.next_power_of_2(k)), num_warps=4)
    return q, scale

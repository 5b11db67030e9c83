"""Batch-1 linear layers as one Triton GEMV each, with the op before them fused in (CUDA only).

At one token a step every linear layer streams its weight once; what else costs is the number of kernels.
`gemv` computes y = f(x) W^T (+ b) for a single row x, where f is one of:
- `None`: x itself;
- `"add_norm"`: RMSNorm(x + residual) · w_norm, writing x + residual out (the residual stream) as well;
- `"silu_mul"`: silu(gate) · up of x = gate ‖ up (the MLP's activation before down_proj).
Each program computes BLOCK_N outputs, streaming their weight rows in BLOCK_K chunks (16-byte loads).
On an H100 it streamed the lm_head (32-row × 128 tiles) at 2.9 TB/s, ~cuBLAS, but lost to cuBLAS on the
layer shapes (2–8-row × 512 tiles reduce across warps); `applies` picks per shape. Its timing is of
launches from Python, so for small weights it compares launch costs, not GPU time (see the README).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.engine.kernels.triton_ops import _round

K_MULTIPLE = 512  # every BLOCK_K below divides it
_choices: dict[tuple[int, int, torch.dtype, bool], bool] = {}
timings_us: dict[tuple[int, int, torch.dtype, bool], tuple[float, float]] = {}  # (this GEMV, cuBLAS), per shape


def _blocks(n: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): ~512-1024 programs, so that each SM has several loads in flight, and few re-reads of
    the fused prologue's input; tiles of at most 4096 weights."""
    block_n = min(32, max(2, triton.next_power_of_2(n // 768)))
    return block_n, min(K_MULTIPLE, 4096 // block_n)


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, b_ptr, y_ptr, N, eps, stride_wn, K: tl.constexpr,
                 PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """PROLOGUE: 0 none, 1 add + RMSNorm, 2 silu-and-mul (x holds 2K values)."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    k = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    r = 1.0
    if PROLOGUE == 1:  # the row's RMS first (the row is small and stays in L1/L2)
        sq = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xs = _round(tl.load(x_ptr + k0 + k).to(tl.float32) + tl.load(res_ptr + k0 + k).to(tl.float32), dtype)
            if pid == 0:
                tl.store(res_out_ptr + k0 + k, xs.to(dtype))
            sq += xs * xs
        r = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if PROLOGUE == 1:
            xs = _round(tl.load(x_ptr + k0 + k).to(tl.float32) + tl.load(res_ptr + k0 + k).to(tl.float32), dtype)
            xs = _round(tl.load(norm_w_ptr + k0 + k).to(tl.float32) * _round(xs * r, dtype), dtype)
        elif PROLOGUE == 2:
            gate = tl.load(x_ptr + k0 + k).to(tl.float32)
            up = tl.load(x_ptr + K + k0 + k).to(tl.float32)
            xs = _round(_round(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)
        else:
            xs = tl.load(x_ptr + k0 + k).to(tl.float32)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + (k0 + k)[None, :], mask=nmask[:, None], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xs[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, acc.to(y_ptr.dtype.element_ty), mask=nmask)


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """One row on CUDA, K a multiple of the chunk (no masks on the stream), and this kernel measured no slower
    than cuBLAS for this weight shape (measured once per shape, outside any CUDA-graph capture)."""
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_cuda or weight.shape[1] % K_MULTIPLE or weight.stride(1) != 1:
        return False
    key = (*weight.shape, weight.dtype, bias is not None)
    if key not in _choices:
        if torch.cuda.is_current_stream_capturing():
            return False
        timings_us[key] = _measure(x, weight, bias)
        _choices[key] = timings_us[key][0] <= timings_us[key][1] + 2.0  # a tie: the fused prologue saves a kernel
    return _choices[key]


def _time(fn, reps: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps * 1e3  # microseconds


def _measure(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[float, float]:
    """Microseconds of this GEMV and of cuBLAS on this shape."""
    probe = torch.randn((1, weight.shape[1]), dtype=x.dtype, device=x.device)  # x may be gate ‖ up: 2K wide
    return _time(lambda: gemv(probe, weight, bias)), _time(lambda: torch.nn.functional.linear(probe, weight, bias))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, prologue: str | None = None,
         residual: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None):
    """y [1, N] = f(x) W^T + b; with prologue "add_norm" returns (y, x + residual)."""
    N, K = weight.shape
    x = x.contiguous()
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if prologue == "add_norm" else x
    norm_w, eps = norm if norm is not None else (x, 0.0)
    code = {None: 0, "add_norm": 1, "silu_mul": 2}[prologue]
    block_n, block_k = _blocks(N)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, residual if residual is not None else x, norm_w, res_out, weight, bias if bias is not None else weight, y,
        N, eps, weight.stride(0), K=K, PROLOGUE=code, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4)
    return (y, res_out) if prologue == "add_norm" else y

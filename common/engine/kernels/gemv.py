"""Batch-1 linear layers as one Triton GEMV each, with the op before them fused in (CUDA only).

At one token a step every linear layer streams its weight once; what else costs is the number of kernels.
`gemv` computes y = f(x) W^T (+ b) for a single row x, where f is one of:
- `None`: x itself;
- `"add_norm"`: RMSNorm(x + residual) · w_norm, writing x + residual out (the residual stream) as well;
- `"silu_mul"`: silu(gate) · up of x = gate ‖ up (the MLP's activation before down_proj).
Each program computes BLOCK_N outputs, streaming their weight rows in BLOCK_K chunks into a 2-D float32
accumulator that is reduced across the tile once, at the end (a reduction per chunk, as an earlier version
did, cost more than the loads on the layer shapes). The norm takes one pass too: 1/rms is a scalar of the
row, so it scales the finished sums; the normalised input is therefore not rounded to the model dtype
between the norm and the product as torch's separate ops do (bf16 results differ within rounding).

Whether it beats cuBLAS depends on the shape, so `applies` decides per (shape, prologue) by timing both the
way a decode step runs them: inside a CUDA graph, back to back over rotating weight copies (so the L2 holds
none of them), cuBLAS paying for its separate prologue kernel. `python -m benchmarks.gpu.sweep_gemv` searches the
tile configurations; `TUNED` holds what it found on a Hopper GPU (sm_90).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from common.devices import graph_capture
from common.engine.kernels.triton_ops import _round

PROLOGUES = {None: 0, "add_norm": 1, "silu_mul": 2}


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class GemvChoice:
    """What `applies` measured for one (shape, prologue), with `config_for`'s tile: µs per call inside a CUDA graph."""

    ours_us: float
    cublas_us: float

    @property
    def uses_gemv(self) -> bool:
        return self.ours_us <= self.cublas_us


choices: dict[tuple, GemvChoice] = {}


# The best tile of `python -m benchmarks.gpu.sweep_gemv` on a Hopper GPU (bf16, in-graph µs next to cuBLAS with its
# prologue kernel), for the Llama-3.2-1B and 3B shapes: (N, K) -> config.
TUNED = {
    (3072, 2048): GemvConfig(4, 512, 4, 3),  # 1B qkv: 6.7 µs vs 8.5
    (2048, 2048): GemvConfig(2, 1024, 4, 3),  # 1B o: 4.6 vs 6.4
    (16384, 2048): GemvConfig(4, 1024, 4, 3),  # 1B gate_up: 25.0 vs 28.0
    (2048, 8192): GemvConfig(8, 2048, 8, 3),  # 1B down: 13.2 vs 17.0
    (128256, 2048): GemvConfig(2, 1024, 4, 3),  # 1B lm_head: 165.7 vs 189.3
    (5120, 3072): GemvConfig(8, 512, 4, 3),  # 3B qkv: 12.8 vs 15.7
    (3072, 3072): GemvConfig(4, 1024, 4, 3),  # 3B o: 8.1 vs 11.2
    (16384, 3072): GemvConfig(4, 1024, 4, 4),  # 3B gate_up: 35.8 vs 39.7
    (3072, 8192): GemvConfig(4, 1024, 2, 4),  # 3B down: 19.4 vs 22.9
    (128256, 3072): GemvConfig(1, 1024, 4, 3),  # 3B lm_head: 247.7 vs 283.0
}


def config_for(n: int, k: int) -> GemvConfig:
    """The tile for an N × K weight: the tuned one, else what the sweep favoured overall: few rows a program
    (one for a vocabulary-sized N) and the longest chunk up to 1024 that divides K."""
    if (n, k) in TUNED:
        return TUNED[(n, k)]
    block_k = next((b for b in (1024, 512, 256, 128) if k % b == 0), 128)
    return GemvConfig(1 if n >= 65536 else 4, block_k, 4, 3)


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, w_scale_ptr, b_ptr, y_ptr, N, K, eps, stride_wn,
                 PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, EVEN_N: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """PROLOGUE: 0 none, 1 add + RMSNorm, 2 silu-and-mul (x holds 2K values). K is a multiple of BLOCK_K.
    HAS_SCALE: W is FP8 with one float32 scale a row (Fp8Linear's), which multiplies the row's finished sum."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    sq = tl.zeros([BLOCK_K], tl.float32)
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :]
    for k0 in range(0, K, BLOCK_K):
        if PROLOGUE == 1:  # one pass: RMSNorm's 1/rms is a scalar, applied to the sum at the end
            xs = _round(tl.load(x_ptr + k0 + k).to(tl.float32) + tl.load(res_ptr + k0 + k).to(tl.float32), dtype)
            if pid == 0:
                tl.store(res_out_ptr + k0 + k, xs.to(dtype))
            sq += xs * xs
            xs = tl.load(norm_w_ptr + k0 + k).to(tl.float32) * xs
        elif PROLOGUE == 2:
            gate = tl.load(x_ptr + k0 + k).to(tl.float32)
            up = tl.load(x_ptr + K + k0 + k).to(tl.float32)
            xs = _round(_round(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)
        else:
            xs = tl.load(x_ptr + k0 + k).to(tl.float32)
        if EVEN_N:  # the weight is read once: let it leave the cache first
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs + k0, mask=(n < N)[:, None], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * xs[None, :]
    out = tl.sum(acc, axis=1)
    if PROLOGUE == 1:
        out = out * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    if HAS_SCALE:
        out = out * tl.load(w_scale_ptr + n, mask=n < N, other=0.0)
    if HAS_BIAS:
        out += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, out.to(y_ptr.dtype.element_ty), mask=n < N)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, prologue: str | None = None,
         residual: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
         config: GemvConfig | None = None, scale: torch.Tensor | None = None):
    """y [1, N] = f(x) W^T + b; with prologue "add_norm" returns (y, x + residual). `scale` [N, 1] (float32): W is
    FP8 and row n of it stands for scale[n] · W[n] (an Fp8Linear's weight_scale, one per row)."""
    N, K = weight.shape
    config = config or config_for(N, K)
    x = x.contiguous()
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if prologue == "add_norm" else x
    norm_w, eps = norm if norm is not None else (x, 0.0)
    _gemv_kernel[(triton.cdiv(N, config.block_n),)](
        x, residual if residual is not None else x, norm_w, res_out, weight, scale if scale is not None else x,
        bias if bias is not None else x, y, N, K, eps, weight.stride(0), PROLOGUE=PROLOGUES[prologue],
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
        EVEN_N=N % config.block_n == 0, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return (y, res_out) if prologue == "add_norm" else y


def fits(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig) -> bool:
    return x.dim() == 2 and x.shape[0] == 1 and x.is_cuda and weight.stride(1) == 1 and \
        weight.shape[1] % config.block_k == 0


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: str | None = None,
            scale: torch.Tensor | None = None) -> bool:
    """One row on CUDA, K a multiple of the tile's chunk, and this kernel measured no slower than cuBLAS with
    its separate prologue kernel (with `scale`, an FP8 weight: than what Fp8Linear runs, its FP8 GEMM with the
    activations' quantisation, or the dequantised weight where that GEMM does not take the shape), for this shape
    (measured once, outside any CUDA-graph capture)."""
    config = config_for(*weight.shape)
    if not fits(x, weight, config):
        return False
    key = (*weight.shape, weight.dtype, x.dtype, bias is not None, prologue)
    if key not in choices:
        if torch.cuda.is_current_stream_capturing():
            return False
        ours, theirs = compare(weight, bias, prologue, config, scale, x.dtype)
        choices[key] = GemvChoice(ours, theirs)
    return choices[key].uses_gemv


def compare(weight: torch.Tensor, bias: torch.Tensor | None, prologue: str | None, config: GemvConfig,
            scale: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> tuple[float, float]:
    """µs per call, inside a CUDA graph, of this GEMV and of (the prologue as its own kernel +) cuBLAS (an FP8
    weight: its FP8 GEMM)."""
    from common.engine.kernels import triton_ops
    from common.engine.quantization.fp8_linear import dequantize, gemm_dims_fit, scaled_mm_linear

    N, K = weight.shape
    copies = weight_copies(weight)
    dev, dt = weight.device, dtype or weight.dtype
    x = torch.randn((1, 2 * K if prologue == "silu_mul" else K), dtype=dt, device=dev)
    res, norm_w = torch.randn((1, K), dtype=dt, device=dev), torch.rand(K, dtype=dt, device=dev) + 0.5

    def ours(i: int):
        return gemv(x, copies[i], bias, prologue, res, (norm_w, 1e-5), config, scale)

    def cublas(i: int):
        h = x
        if prologue == "add_norm":
            h, _ = triton_ops.add_rms_norm(x, res, norm_w, 1e-5)
        elif prologue == "silu_mul":
            h = triton_ops.silu_and_mul(x)
        if scale is not None:  # what Fp8Linear runs in our place: its FP8 GEMM, or the dequantised weight
            if gemm_dims_fit(N, K):
                return scaled_mm_linear(h, copies[i], scale, bias)
            return torch.nn.functional.linear(h, dequantize(copies[i], scale, None, h.dtype), bias)
        return torch.nn.functional.linear(h, copies[i], bias)

    return graph_time_us(ours, len(copies)), graph_time_us(cublas, len(copies))


def weight_copies(weight: torch.Tensor, l2_bytes: int = 128 << 20) -> list[torch.Tensor]:
    """The weight and enough copies that cycling through them never finds one in the L2 (the default: more than a GPU's
    L2 holds)."""
    n = min(16, max(1, math.ceil(l2_bytes / (weight.numel() * weight.element_size()))))
    return [weight] + [weight.clone() for _ in range(n - 1)]


def graph_time_us(fn: Callable[[int], object], calls: int, replays: int = 10) -> float:
    """Mean µs of fn(i), i cycling over range(calls), captured back to back in one CUDA graph and replayed:
    what a decode graph pays for it, launch gaps included."""
    calls_in_graph = max(calls, 8)
    fn(0)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph, torch.device("cuda", torch.cuda.current_device())):
        for i in range(calls_in_graph):
            fn(i % calls)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls_in_graph)

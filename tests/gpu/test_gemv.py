"""The batch-1 Triton GEMV (with each fused prologue) against torch: reference prologue, then F.linear.
Skipped without a CUDA GPU and triton."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from common.engine.kernels import gemv as G  # noqa: E402
from common.engine.kernels import reference  # noqa: E402

CUDA = torch.device("cuda")
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
SHAPES = [(3072, 2048), (2048, 8192), (16384, 2048), (5120, 3072), (3072, 8192), (1000, 1024)]  # (N, K)


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert not got.isnan().any()
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prologue", [None, "add_norm", "silu_mul"], ids=["plain", "add_norm", "silu_mul"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_gemv_matches_torch(shape, prologue, dtype):
    n, k = shape
    gen = torch.Generator(CUDA).manual_seed(n + k)

    def rand(*size):
        return torch.randn(*size, generator=gen, device=CUDA).to(dtype)

    w, b = rand(n, k) * 0.05, (rand(n) if prologue != "add_norm" else None)
    if prologue == "add_norm":
        x, res, norm_w = rand(1, k), rand(1, k), rand(k)
        y, total = G.gemv(x, w, b, "add_norm", res, (norm_w, 1e-5))
        h, ref_total = reference.add_rms_norm(x, res, norm_w, 1e-5)
        assert torch.equal(total, ref_total)
    elif prologue == "silu_mul":
        x = rand(1, 2 * k)
        y = G.gemv(x, w, b, "silu_mul")
        h = reference.silu_and_mul(x)
    else:
        h = rand(1, k)
        y = G.gemv(h, w, b)
    expected = F.linear(h.double(), w.double(), None if b is None else b.double())
    err = _rel(y, expected)
    print(f"\n[gemv {n}x{k} {prologue} {dtype}] rel error {err:.2e}")
    assert err < REL_TOL[dtype]


def test_applies_only_to_one_row_and_records_both_timings():
    w = torch.randn(4096, 2048, device=CUDA, dtype=torch.bfloat16)
    assert not G.applies(torch.randn(2, 2048, device=CUDA, dtype=torch.bfloat16), w, None)
    uses = G.applies(torch.randn(1, 2048, device=CUDA, dtype=torch.bfloat16), w, None, "add_norm")
    choice = G.choices[(4096, 2048, torch.bfloat16, torch.bfloat16, False, "add_norm")]
    print(f"\n[gemv 4096x2048 bf16 add_norm, in a CUDA graph] ours {choice.ours_us:.1f} µs, "
          f"norm kernel + cuBLAS {choice.cublas_us:.1f} µs")
    assert choice.ours_us > 0 and choice.cublas_us > 0 and uses == (choice.ours_us <= choice.cublas_us)


def test_graph_timing_sees_hbm_not_l2():
    """A 16 MB weight timed over rotating copies reads from HBM: no faster than ~3.5 TB/s (an H100's ~3.35)."""
    w = torch.randn(4096, 2048, device=CUDA, dtype=torch.bfloat16)
    copies = G.weight_copies(w)
    x = torch.randn(1, 2048, device=CUDA, dtype=torch.bfloat16)
    us = G.graph_time_us(lambda i: F.linear(x, copies[i]), len(copies))
    assert w.numel() * 2 / (us * 1e-6) < 3.6e12


@pytest.mark.parametrize("prologue", [None, "add_norm", "silu_mul"], ids=["plain", "add_norm", "silu_mul"])
@pytest.mark.parametrize("shape", [(5120, 3072), (3072, 8192), (1000, 1024)], ids=["5120x3072", "3072x8192", "1000x1024"])
def test_gemv_runs_fp8_rows_with_their_scales(shape, prologue):
    """An Fp8Linear's weight (FP8, one scale a row) at batch 1: the product of the dequantised weight, bf16 in and out,
    and `applies` times it against the FP8 GEMM with its activations' quantisation."""
    from common.engine.quantization.fp8_linear import dequantize, quantize_rows

    n, k = shape
    gen = torch.Generator(CUDA).manual_seed(n + k)
    w, scale = quantize_rows(torch.randn(n, k, generator=gen, device=CUDA) * 0.05)
    wd = dequantize(w, scale, None, torch.float64)
    x = torch.randn(1, 2 * k if prologue == "silu_mul" else k, generator=gen, device=CUDA).to(torch.bfloat16)
    if prologue == "add_norm":
        res, norm_w = torch.randn(1, k, device=CUDA).to(torch.bfloat16), torch.rand(k, device=CUDA).to(torch.bfloat16)
        y, _ = G.gemv(x, w, None, "add_norm", res, (norm_w, 1e-5), scale=scale)
        h, _ = reference.add_rms_norm(x, res, norm_w, 1e-5)
    elif prologue == "silu_mul":
        y, h = G.gemv(x, w, None, "silu_mul", scale=scale), reference.silu_and_mul(x)
    else:
        y, h = G.gemv(x, w, None, scale=scale), x
    assert y.dtype == torch.bfloat16 and _rel(y, h.double() @ wd.T) < REL_TOL[torch.bfloat16]
    G.applies(x, w, None, prologue, scale)
    choice = G.choices[(n, k, w.dtype, torch.bfloat16, False, prologue)]
    print(f"\n[fp8 gemv {n}x{k} {prologue}, in a CUDA graph] ours {choice.ours_us:.1f} µs, FP8 GEMM {choice.cublas_us:.1f} µs")
    assert choice.ours_us > 0 and choice.cublas_us > 0


def test_tokens_quantise_in_one_kernel_as_torch_does():
    """The fused per-token FP8 quantisation (fp8_triton.py) = the torch ops it replaces, scale and FP8 bytes alike."""
    from common.engine.quantization.fp8_linear import FP8, FP8_MAX, _MIN_SCALE
    from common.engine.quantization.fp8_triton import quantize_tokens

    rows = torch.randn(37, 3072, device=CUDA).to(torch.bfloat16) * torch.logspace(-3, 2, 37, device=CUDA)[:, None].to(torch.bfloat16)
    rows[5] = 0
    q, scale = quantize_tokens(rows, FP8, FP8_MAX, _MIN_SCALE)
    want_scale = (rows.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    want = (rows.float() / want_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want.view(torch.uint8))

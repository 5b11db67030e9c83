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
    choice = G.choices[(4096, 2048, torch.bfloat16, False, "add_norm")]
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

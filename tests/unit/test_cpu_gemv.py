"""cpu_gemv: a decode step's bf16 GEMV (up to 8 input rows) whose output rows the engine thread shares with a helper thread on another core. The
values are the float32 sums of bf16 products, rounded once; shared, revoked or not, every row is the same bits,
whoever computed it. Skipped where the CPU has no bf16 dot products (the kernel is not built for it)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from common.engine import cpu_gemv
from common.cpu_cores import HELPER_CORES_ENV, usable_cores


@pytest.fixture(scope="module")
def lib():
    cores = usable_cores()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(HELPER_CORES_ENV, str(cores[-1]))
        cpu_gemv._lib.cache_clear()
        built = cpu_gemv._lib()
    if built is None:
        pytest.skip("no bf16 dot products on this CPU (or no C compiler)")
    yield built
    cpu_gemv._lib.cache_clear()


def _call(lib, w, x, bias, share: int, wait_us: int) -> tuple[torch.Tensor, int]:
    y = torch.empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16)
    helped = lib.gemv_bf16(w.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                           x.shape[0], w.shape[1], w.shape[0], ctypes.c_int(share), ctypes.c_int(wait_us))
    if helped & 1:  # the helper may still read them (a chunk taken back): keep them as cpu_gemv.gemv does
        cpu_gemv._held.append((w, bias, x))
    return y, helped >> 1


@pytest.mark.parametrize(("m", "out", "inp"), [(1, 576, 576), (1, 3072, 576), (1, 61, 70), (1, 4099, 1536),
                                              (3, 576, 576), (8, 1000, 200)])
def test_rows_are_the_bf16_rounded_float32_sums_whoever_computes_them(lib, m, out, inp):
    g = torch.Generator().manual_seed(out)
    w = torch.randn((out, inp), generator=g).to(torch.bfloat16)
    x = torch.randn((m, inp), generator=g).to(torch.bfloat16)
    bias = torch.randn(out, generator=g).to(torch.bfloat16)
    alone, helped = _call(lib, w, x, bias, share=0, wait_us=0)
    assert helped == 0
    want = (x.float() @ w.float().T + bias.float()).to(torch.bfloat16)
    # the same sums in another order: within a bf16 step of the rounded float32 answer
    assert torch.allclose(alone.float(), want.float(), rtol=2 ** -7, atol=1e-3 * inp ** 0.5)
    # Shared: whichever chunks the helper got (none where its core is busy: it runs at idle priority), the same bits.
    for _ in range(200):
        shared, _ = _call(lib, w, x, bias, share=1, wait_us=cpu_gemv.WAIT_US)
        assert torch.equal(shared, alone)
    for _ in range(50):  # never waiting for the helper: every chunk it holds is revoked and computed here
        revoked, _ = _call(lib, w, x, bias, share=1, wait_us=0)
        assert torch.equal(revoked, alone)


def test_applies_to_a_decode_steps_bf16_rows_on_one_thread_only(lib, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert cpu_gemv.applies(torch.zeros((1, 8), dtype=torch.bfloat16))
    assert not cpu_gemv.applies(torch.zeros((cpu_gemv.MAX_ROWS + 1, 8), dtype=torch.bfloat16))
    assert not cpu_gemv.applies(torch.zeros((1, 8)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not cpu_gemv.applies(torch.zeros((1, 8), dtype=torch.bfloat16))

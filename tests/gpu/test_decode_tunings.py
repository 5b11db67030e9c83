"""The decode kernel gives the reference's result under every launch shape the sweep tries."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from common.engine.attention_triton import DecodeTuning, TritonPagedAttention  # noqa: E402
from benchmarks.gpu.attention_cases import max_error_against_reference  # noqa: E402

CUDA = torch.device("cuda")
TUNINGS = [DecodeTuning(), DecodeTuning(32, 4, 2, 1024), DecodeTuning(128, 8, 3, 2048, 64),
           DecodeTuning(64, 4, 4, 4096, 64)]


@pytest.mark.parametrize("tuning", TUNINGS, ids=[str(i) for i in range(len(TUNINGS))])
@pytest.mark.parametrize("window", [None, 100], ids=["full", "window100"])
def test_decode_agrees_with_the_reference_under_each_tuning(tuning, window):
    ctx = [0, 1, 15, 300, 2000, 5000]
    backend = TritonPagedAttention(16, {window}, CUDA, tuning)
    err = max_error_against_reference(backend, ctx, [1] * len(ctx), window, seed=3)
    print(f"\n[decode {tuning} window={window}] max abs error {err:.3g}")
    assert err < 2e-2

"""The prefill kernel gives the reference's result under every launch shape the sweep tries: fresh prompts, chunks
after a cached context that is not a multiple of the key block, decode rows beside them, a sliding window."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from common.engine.attention_triton import PrefillTuning, TritonPagedAttention  # noqa: E402
from benchmarks.gpu.attention_cases import max_error_against_reference  # noqa: E402
from benchmarks.gpu.sweep_prefill_attention import TUNINGS  # noqa: E402

CUDA = torch.device("cuda")


@pytest.mark.parametrize("tuning", TUNINGS, ids=["-".join(map(str, t)) for t in TUNINGS])
@pytest.mark.parametrize("window", [None, 100], ids=["full", "window100"])
def test_prefill_agrees_with_the_reference_under_each_tuning(tuning, window):
    backend = TritonPagedAttention(16, {window}, CUDA, prefill_tuning=PrefillTuning(*tuning))
    err = max_error_against_reference(backend, [0, 0, 37, 1000, 5, 130], [1, 300, 129, 200, 1, 64], window, seed=5)
    print(f"\n[prefill {tuning} window={window}] max abs error {err:.3g}")
    assert err < 2e-2

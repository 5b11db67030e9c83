"""The prefill kernel gives the reference's result under every launch shape the sweep tries: fresh prompts, chunks
after a cached context that is not a multiple of the key block, decode rows beside them, a sliding window."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from common.engine.attention import BatchLayout, TorchPagedAttention  # noqa: E402
from common.engine.attention_triton import PrefillTuning, TritonPagedAttention  # noqa: E402
from tests.gpu.sweep_prefill_attention import TUNINGS  # noqa: E402

CUDA = torch.device("cuda")


@pytest.mark.parametrize("tuning", TUNINGS, ids=["-".join(map(str, t)) for t in TUNINGS])
@pytest.mark.parametrize("window", [None, 100], ids=["full", "window100"])
def test_prefill_agrees_with_the_reference_under_each_tuning(tuning, window):
    gen = torch.Generator().manual_seed(5)
    block_size, num_blocks, heads, kv_heads, dim = 16, 1024, 24, 8, 128
    ctx = [0, 0, 37, 1000, 5, 130]
    qlen = [1, 300, 129, 200, 1, 64]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for c, n in zip(ctx, qlen):
        blocks = -(-(c + n) // block_size)
        tables.append(perm[used: used + blocks])
        used += blocks
    layout = BatchLayout(query_lens=qlen, context_lens=ctx, block_tables=tables)
    T = sum(qlen)
    q = torch.randn(T, heads, dim, generator=gen).bfloat16()
    k = torch.randn(T, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(T, kv_heads, dim, generator=gen).bfloat16()
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).bfloat16().to(CUDA)
    ref = TorchPagedAttention(block_size, {window}, CUDA)
    expected = ref.forward(q.float().to(CUDA), k.float().to(CUDA), v.float().to(CUDA), cache.float(),
                           ref.prepare(layout), dim**-0.5, window)
    backend = TritonPagedAttention(block_size, {window}, CUDA, prefill_tuning=PrefillTuning(*tuning))
    got = backend.forward(q.to(CUDA), k.to(CUDA), v.to(CUDA), cache, backend.prepare(layout), dim**-0.5, window)
    err = (got.float() - expected).abs().max().item()
    print(f"\n[prefill {tuning} window={window}] max abs error {err:.3g}")
    assert err < 2e-2

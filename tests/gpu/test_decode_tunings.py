"""The decode kernel gives the reference's result under every launch shape the sweep tries."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from common.engine.attention import BatchLayout, TorchPagedAttention  # noqa: E402
from common.engine.attention_triton import DecodeTuning, TritonPagedAttention  # noqa: E402

CUDA = torch.device("cuda")
TUNINGS = [DecodeTuning(), DecodeTuning(32, 4, 2, 1024), DecodeTuning(128, 8, 3, 2048, 64),
           DecodeTuning(64, 4, 4, 4096, 64)]


@pytest.mark.parametrize("tuning", TUNINGS, ids=[str(i) for i in range(len(TUNINGS))])
@pytest.mark.parametrize("window", [None, 100], ids=["full", "window100"])
def test_decode_agrees_with_the_reference_under_each_tuning(tuning, window):
    gen = torch.Generator().manual_seed(3)
    block_size, num_blocks, heads, kv_heads, dim = 16, 1024, 24, 8, 128
    ctx = [0, 1, 15, 300, 2000, 5000]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for c in ctx:
        n = -(-(c + 1) // block_size)
        tables.append(perm[used: used + n])
        used += n
    layout = BatchLayout(query_lens=[1] * len(ctx), context_lens=ctx, block_tables=tables)
    q = torch.randn(len(ctx), heads, dim, generator=gen).bfloat16()
    k = torch.randn(len(ctx), kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(len(ctx), kv_heads, dim, generator=gen).bfloat16()
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).bfloat16().to(CUDA)
    ref = TorchPagedAttention(block_size, {window}, CUDA)
    expected = ref.forward(q.float().to(CUDA), k.float().to(CUDA), v.float().to(CUDA), cache.float(),
                           ref.prepare(layout), dim**-0.5, window)
    backend = TritonPagedAttention(block_size, {window}, CUDA, tuning)
    got = backend.forward(q.to(CUDA), k.to(CUDA), v.to(CUDA), cache, backend.prepare(layout), dim**-0.5, window)
    err = (got.float() - expected).abs().max().item()
    print(f"\n[decode {tuning} window={window}] max abs error {err:.3g}")
    assert err < 2e-2

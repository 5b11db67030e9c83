"""The CPU's C prefill attention kernel (common/engine/cpu_attention.c, paged_prefill_attention) against the torch
path it replaces (TorchPagedAttention gathering each prefill's blocks, then SDPA in float32).

Tolerance: float32 1e-5 (the same products summed in another order, the softmax normalised at the end); bf16 one
bf16 rounding of the result (rtol 2^-7) and 1e-2 absolute for values of unit scale: both sides compute in float32
from the same bf16 inputs and round once, so they differ only where float32's last bits land on the other side of
a bf16 rounding."""
from __future__ import annotations

import pytest
import torch

from common.engine import cpu_attention
from common.engine.attention import BatchLayout, TorchPagedAttention
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.quantization.fp8_linear import FP8
from common.engine.quantization.kv_cache import KvCacheFormat
from common.engine.request import SamplingParams

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2**-7)}

pytestmark = pytest.mark.skipif(cpu_attention.kernel() is None, reason="no C compiler for the CPU attention kernel")


def _kernel_and_torch(monkeypatch, layout: BatchLayout, heads: tuple[int, int, int], dtype: torch.dtype,
                      window: int | None, kv: KvCacheFormat | None = None, block_size: int = 4,
                      q_scale: float = 1.0):
    """The step's attention output with the kernel, then with the torch path: the same q and cache, K/V of the
    step's tokens written by the forward. `q_scale` widens the scores' spread."""
    hq, hkv, d = heads
    tokens = sum(layout.query_lens)
    q, k, v = (torch.randn(tokens, h, d).to(dtype) for h in (hq, hkv, hkv))
    q = (q.float() * q_scale).to(dtype)
    blocks = 1 + max(b for table in layout.block_tables for b in table)
    cache = torch.randn(2, blocks, block_size, hkv, d).to(kv.dtype if kv else dtype)

    def attend() -> torch.Tensor:
        attention = TorchPagedAttention(block_size, {window}, CPU, kv)
        return attention.forward(q, k, v, cache.clone(), attention.prepare(layout), scale=d**-0.5, window=window)

    assert cpu_attention.prefill_applies(q, cache[0])
    calls = []
    prefill = cpu_attention.prefill
    monkeypatch.setattr(cpu_attention, "prefill", lambda *args: calls.append(1) or prefill(*args))
    mine = attend()
    assert calls, "the prefill kernel did not run"
    monkeypatch.setattr(cpu_attention, "prefill_applies", lambda *args: False)
    return mine.float(), attend().float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("heads", [(9, 3, 64), (6, 2, 24), (4, 4, 128)])
def test_chunks_over_their_cached_context_equal_the_torch_path(monkeypatch, one_thread, dtype, window, heads):
    """Three prefills in one step, blocks scattered: a chunk of 7 after 9 cached tokens, a first chunk of 37
    (past a tile of 16 queries, odd), a chunk of 3 after 50 cached, each beside a decode; GQA groups of 3, 3 and 1,
    head sizes of the fast paths (64, 128) and another; with and without a sliding window."""
    torch.manual_seed(0)
    layout = BatchLayout(query_lens=[7, 1, 37, 3, 1], context_lens=[9, 12, 0, 50, 3],
                         block_tables=[[11, 2, 5, 0], [3, 9, 1, 4], [6, 8, 10, 12, 13, 14, 15, 16, 17, 18],
                                       [30 - i for i in range(14)], [7]])
    mine, want = _kernel_and_torch(monkeypatch, layout, heads, dtype, window)
    torch.testing.assert_close(mine, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 150])
def test_a_long_context_is_read_in_several_passes(monkeypatch, one_thread, dtype, window):
    """A chunk of 21 after 290 cached tokens: its keys span the kernel's 128-key passes, so each row's running
    maximum and sum carry from one pass to the next (and a window starts mid-pass)."""
    torch.manual_seed(3)
    layout = BatchLayout(query_lens=[21], context_lens=[290], block_tables=[list(range(80, 0, -1))])
    mine, want = _kernel_and_torch(monkeypatch, layout, (9, 3, 64), dtype, window)
    torch.testing.assert_close(mine, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_spread_past_the_exponent_range_stay_finite(monkeypatch, one_thread, dtype):
    """Scores a row sees that lie more than 87.3 below its maximum (exp of them under float32's smallest normal, as a
    long prompt's do in SmolLM2's deep layers) weigh ~0, not the garbage of an exponent taken past its range."""
    torch.manual_seed(4)
    layout = BatchLayout(query_lens=[106], context_lens=[256], block_tables=[list(range(30))])
    mine, want = _kernel_and_torch(monkeypatch, layout, (9, 3, 64), dtype, None, block_size=16, q_scale=40.0)
    assert torch.isfinite(mine).all()
    torch.testing.assert_close(mine, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_scale", [1.0, 0.5])
def test_an_fp8_cache_is_read_as_the_torch_path_reads_it(monkeypatch, one_thread, dtype, kv_scale):
    """FP8 values are exact in bf16, so the torch path's dequantised read and the kernel's table agree."""
    torch.manual_seed(1)
    layout = BatchLayout(query_lens=[19, 5], context_lens=[0, 22],
                         block_tables=[[4, 1, 0, 3, 2], [9, 5, 6, 7, 8, 10, 11]])
    mine, want = _kernel_and_torch(monkeypatch, layout, (6, 2, 32), dtype, None, KvCacheFormat(FP8, kv_scale))
    torch.testing.assert_close(mine, want, **TOLERANCE[dtype])


def test_a_two_token_prompt_and_blocks_of_one_token(monkeypatch, one_thread):
    """Edges: the shortest prefill (one token would be a decode) and every key in a block of its own."""
    torch.manual_seed(2)
    layout = BatchLayout(query_lens=[2, 17], context_lens=[0, 3], block_tables=[[1, 0], list(range(2, 22))])
    mine, want = _kernel_and_torch(monkeypatch, layout, (2, 1, 8), torch.float32, None, block_size=1)
    torch.testing.assert_close(mine, want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("family", ["llama-gqa", "qwen3-qknorm"])
def test_bf16_engine_with_the_prefill_kernel_generates_as_without(tiny_model_dirs, family, monkeypatch, one_thread):
    """Greedy bf16 through the whole engine (prompts of 13 and 6 tokens prefilled in chunks of 4 beside decodes):
    the same tokens with the C prefill kernel (called) as with the torch path for prefills."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (13, 6)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    config = EngineConfig(model=tiny_model_dirs[family], dtype="bfloat16", block_size=4, num_kv_blocks=64,
                          long_prefill_token_threshold=4)
    calls = []
    prefill = cpu_attention.prefill
    monkeypatch.setattr(cpu_attention, "prefill", lambda *args: calls.append(1) or prefill(*args))
    with_kernel = LLMEngine(config).generate(prompts, greedy)
    assert calls
    monkeypatch.setattr(cpu_attention, "prefill_applies", lambda *args: False)  # decodes keep their kernel
    assert LLMEngine(config).generate(prompts, greedy) == with_kernel

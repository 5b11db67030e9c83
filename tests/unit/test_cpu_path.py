"""The CPU serving path's own choices: oneDNN-packed bf16 linears, paged attention gathered by block id and run in
float32 for bf16 caches (common/engine/cpu_linear.py, attention.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from common.engine import cpu_attention, cpu_linear, model_runner
from common.engine.attention import BatchLayout, TorchPagedAttention
from common.engine.config import EngineConfig
from common.engine.cpu_linear import pack_linears, packs
from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from tests.hf_reference import hf_greedy
from tests.tiny_models import TINY_FAMILIES

CPU = torch.device("cpu")


@pytest.mark.skipif(not packs(CPU, torch.bfloat16), reason="this CPU's oneDNN has no bf16 GEMM")
def test_packed_linears_give_the_plain_bf16_values():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=True), nn.Linear(96, 48, bias=False)).to(torch.bfloat16)
    inputs = [torch.randn(rows, 64, dtype=torch.bfloat16) for rows in (1, 5, 33)] + [torch.randn(2, 3, 64).bfloat16()]
    with torch.inference_mode():
        plain = [model(x) for x in inputs]
        assert pack_linears(model) == 2
        packed = [model(x) for x in inputs]
    for want, got in zip(plain, packed):
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)


def test_packing_is_for_bf16_on_the_cpu_only():
    assert not packs(CPU, torch.float32)  # float32 stays on MKL, the arithmetic HF's reference runs
    assert not packs(torch.device("cuda"), torch.bfloat16)


def _attend(dtype: torch.dtype, layout: BatchLayout, q, k, v, cache) -> torch.Tensor:
    attention = TorchPagedAttention(block_size=4, windows={None}, device=CPU)
    out = attention.forward(q.to(dtype), k.to(dtype), v.to(dtype), cache.to(dtype), attention.prepare(layout),
                            scale=0.25, window=None)
    return out.float()


def test_bf16_attention_runs_in_float32_over_blocks_in_any_order():
    """Two decodes of different lengths and a prefill chunk after a cached prefix, their blocks scattered: the bf16
    cache gives the float32 answer to bf16 precision, and the float32 one matches a dense causal reference."""
    torch.manual_seed(1)
    hq, hkv, d, bs = 6, 2, 16, 4
    layout = BatchLayout(query_lens=[1, 1, 5], context_lens=[9, 2, 6],
                         block_tables=[[7, 2, 5], [3], [0, 6, 1]])
    t = sum(layout.query_lens)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    cache = torch.randn(2, 8, bs, hkv, d)
    full = _attend(torch.float32, layout, q, k, v, cache.clone())
    half = _attend(torch.bfloat16, layout, q, k, v, cache.clone())
    torch.testing.assert_close(half, full, atol=5e-2, rtol=5e-2)
    # dense reference for the prefill chunk (rows 2..6): its keys are the cached 6 tokens then its own 5
    table, ctx = layout.block_tables[2], layout.context_lens[2]
    cached_k = cache[0][table].flatten(0, 1)[:ctx]
    cached_v = cache[1][table].flatten(0, 1)[:ctx]
    keys, values = torch.cat([cached_k, k[2:]]), torch.cat([cached_v, v[2:]])
    scores = torch.einsum("qhd,khd->hqk", q[2:], keys.repeat_interleave(hq // hkv, dim=1)) * 0.25
    allowed = torch.arange(ctx + 5)[None, :] <= torch.arange(ctx, ctx + 5)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", probs, values.repeat_interleave(hq // hkv, dim=1))
    torch.testing.assert_close(full[2:], want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(cpu_attention.kernel() is None, reason="no C compiler for the CPU attention kernel")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("q_scale", [1.0, 40.0])
def test_decode_kernel_reads_the_blocks_as_the_gathered_path_does(monkeypatch, dtype, tolerance, window, q_scale):
    """Three decodes of different lengths (one spanning a partly filled block), GQA, blocks out of order: the C kernel
    on the cache's own blocks gives what gathering them and SDPA give, with and without a sliding window; also with
    scores spread more than 87.3 below their maximum (exp of them past float32's exponent range: ~0, not garbage)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the kernel's case, whatever the test process has
    torch.manual_seed(2)
    hq, hkv, d = 8, 2, 32
    layout = BatchLayout(query_lens=[1, 1, 1], context_lens=[13, 4, 8], block_tables=[[6, 1, 4, 0], [2, 7], [5, 3, 9]])
    q = (torch.randn(3, hq, d) * q_scale).to(dtype)
    k, v = torch.randn(3, hkv, d, dtype=dtype), torch.randn(3, hkv, d, dtype=dtype)
    cache = torch.randn(2, 10, 4, hkv, d, dtype=dtype)

    def attend() -> torch.Tensor:
        attention = TorchPagedAttention(block_size=4, windows={window}, device=CPU)
        return attention.forward(q, k, v, cache.clone(), attention.prepare(layout), scale=d**-0.5, window=window)

    assert cpu_attention.applies(q, cache[0])
    kernel = attend()
    monkeypatch.setattr(cpu_attention, "applies", lambda *args: False)
    torch.testing.assert_close(kernel.float(), attend().float(), atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(cpu_attention.kernel() is None, reason="no C compiler for the CPU attention kernel")
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (6, 3, 32)])
@pytest.mark.parametrize("window", [None, 21])
def test_bf16_decode_kernel_over_many_key_chunks_reads_as_the_gathered_path(monkeypatch, heads, window):
    """The bf16 decode kernel's shapes (SmolLM2's 9 / 3 heads of 64, Llama's groups of 128, one case of neither):
    contexts of one key, of exactly sixteen and across several sixteen-key chunks, blocks out of order, with and
    without a window; the same answer as gathering the blocks and SDPA, to bf16 precision."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    torch.manual_seed(3)
    hq, hkv, d = heads
    blocks = torch.randperm(40).tolist()
    layout = BatchLayout(query_lens=[1, 1, 1, 1], context_lens=[0, 15, 50, 70],
                         block_tables=[blocks[0:1], blocks[1:5], blocks[5:18], blocks[18:36]])
    q = torch.randn(4, hq, d, dtype=torch.bfloat16) * 3
    k, v = torch.randn(4, hkv, d, dtype=torch.bfloat16), torch.randn(4, hkv, d, dtype=torch.bfloat16)
    cache = torch.randn(2, 40, 4, hkv, d, dtype=torch.bfloat16)

    def attend() -> torch.Tensor:
        attention = TorchPagedAttention(block_size=4, windows={window}, device=CPU)
        return attention.forward(q, k, v, cache.clone(), attention.prepare(layout), scale=d**-0.5, window=window)

    assert cpu_attention.applies(q, cache[0])
    kernel = attend()
    monkeypatch.setattr(cpu_attention, "applies", lambda *args: False)
    torch.testing.assert_close(kernel.float(), attend().float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_one_thread_engine_matches_hf_for_each_family(tiny_model_dirs, family, one_thread):
    """Float32 greedy through the CPU serving path (the decode kernel where it is built) equals Hugging Face."""
    path = tiny_model_dirs[family]
    engine = LLMEngine(EngineConfig(model=path, block_size=4, num_kv_blocks=128))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (6, 19)]
    for prompt, got in zip(prompts, engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10,
                                                                            ignore_eos=True))):
        assert got == hf_greedy(path, prompt, 10)[0]


@pytest.mark.skipif(not packs(CPU, torch.bfloat16), reason="this CPU's oneDNN has no bf16 GEMM")
def test_bf16_engine_packs_its_linears_and_generates_as_unpacked(tiny_llama, monkeypatch):
    prompt = torch.randint(3, 512, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    packed = LLMEngine(EngineConfig(model=tiny_llama, dtype="bfloat16", block_size=4, num_kv_blocks=64))
    assert isinstance(packed.runner.model.lm_head.forward, cpu_linear._PackedForward)
    monkeypatch.setattr(model_runner, "packs", lambda device, dtype: False)
    plain = LLMEngine(EngineConfig(model=tiny_llama, dtype="bfloat16", block_size=4, num_kv_blocks=64))
    assert "forward" not in vars(plain.runner.model.lm_head)
    assert packed.generate([prompt], greedy) == plain.generate([prompt], greedy)

"""The GPU path against the CPU reference: Triton paged attention vs TorchPagedAttention, and the engine
with Triton kernels + CUDA graphs vs Hugging Face greedy. Skipped without a CUDA GPU and triton.

Run on the GPU machine with `python -m pytest -q -s tests/gpu`; `-s` prints the max abs errors.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from common.engine.attention import TorchPagedAttention  # noqa: E402
from common.engine.attention_triton import TritonPagedAttention  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import LLMEngine  # noqa: E402
from common.engine.request import SamplingParams  # noqa: E402
from benchmarks.gpu.attention_cases import scattered_layout  # noqa: E402
from tests.hf_reference import hf_greedy  # noqa: E402
from tests.tiny_models import TINY_FAMILIES  # noqa: E402

CUDA = torch.device("cuda")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
CASES = {  # (context_lens, query_lens): decode-only, prefill from scratch, chunked prefill after a cached prefix, mixed
    "decode": ([0, 15, 16, 63, 64, 200, 1000], [1] * 7),  # small batch: the sequence split over programs
    "decode_wide": ([i * 37 % 700 for i in range(40)], [1] * 40),  # wider batch: fewer or no splits
    "prefill": ([0, 0, 0], [1, 70, 300]),
    "chunked": ([16, 130, 48], [33, 64, 200]),
    "mixed": ([99, 0, 7, 300], [1, 129, 1, 45]),
    "mixed_leading": ([99, 7, 0, 300], [1, 1, 129, 45]),  # decode rows first (the scheduler's order)
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 40], ids=["full", "window40"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [(14, 2, 64), (8, 8, 128), (4, 1, 80)], ids=["gqa7-d64", "mha-d128", "mqa-d80"])
def test_triton_paged_attention_matches_the_torch_reference(case, window, dtype, heads):
    num_heads, num_kv_heads, head_dim = heads
    block_size, num_blocks = 16, 2048
    gen = torch.Generator().manual_seed(0)
    layout = scattered_layout(*CASES[case], block_size, num_blocks, gen)
    T = sum(layout.query_lens)
    q = torch.randn(T, num_heads, head_dim, generator=gen)
    k = torch.randn(T, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(T, num_kv_heads, head_dim, generator=gen)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    # Quantise once so both sides see the same numbers; the reference computes in float32.
    q, k, v, cache = (t.to(dtype) for t in (q, k, v, cache))
    ref_cache = cache.float().to(CUDA)
    reference = TorchPagedAttention(block_size, {window}, CUDA)
    expected = reference.forward(q.float().to(CUDA), k.float().to(CUDA), v.float().to(CUDA), ref_cache,
                                 reference.prepare(layout), head_dim**-0.5, window)
    triton_cache = cache.to(CUDA)
    backend = TritonPagedAttention(block_size, {window}, CUDA)
    got = backend.forward(q.to(CUDA), k.to(CUDA), v.to(CUDA), triton_cache, backend.prepare(layout), head_dim**-0.5,
                          window)
    err = (got.float() - expected).abs().max().item()
    cache_err = (triton_cache.float() - ref_cache).abs().max().item()  # the new tokens' K/V landed in their slots
    print(f"\n[{case} {heads} window={window} {dtype}] max abs error: attention {err:.3g}, kv store {cache_err:.3g}")
    assert cache_err == 0
    assert err < TOLERANCE[dtype]


def _engine(path: str, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cuda", **{"block_size": 4, "num_kv_blocks": 256, **overrides}))


@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_gpu_engine_greedy_matches_hf(tiny_model_dirs, family, eager):
    path = tiny_model_dirs[family]
    engine = _engine(path, enforce_eager=eager, max_num_batched_tokens=16)  # small budget: chunked prefills too
    assert (engine.runner.graphs is None) == eager
    _generates_the_hf_tokens(engine, path, (5, 11, 17, 40))
    if not eager:  # the prompt chunks and mixed steps went through the whole-step graphs (bucket 16)
        assert engine.runner.prefill_graphs.steps > 0


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_prompt_and_mixed_steps_in_whole_step_graphs_match_hf(tiny_model_dirs, family):
    """Steps of 1-100 tokens padded to their bucket (16 ... 100): whole prompts, chunks beside decode rows."""
    path = tiny_model_dirs[family]
    engine = _engine(path, max_num_batched_tokens=100)
    assert engine.runner.prefill_graphs.buckets[-1] == 100
    _generates_the_hf_tokens(engine, path, (5, 11, 17, 40, 90, 150))
    graphs = engine.runner.prefill_graphs
    assert graphs.steps > graphs.mixed_steps > 0  # prompt-only steps, and chunks beside decode rows


def _generates_the_hf_tokens(engine: LLMEngine, path: str, lengths: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, got in zip(prompts, outputs):
        assert got == hf_greedy(path, prompt, 12)[0]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bf16_gpu_engine_agrees_with_the_fp32_cpu_engine_on_most_tokens(tiny_llama):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 30, 64)]
    sampling = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    gpu = _engine(tiny_llama, dtype="bfloat16").generate(prompts, sampling)
    cpu = LLMEngine(EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=256)).generate(prompts, sampling)
    # bf16 rounding may flip a near-tie late in a sequence; the first tokens must agree.
    assert all(a[:4] == b[:4] for a, b in zip(gpu, cpu)), (gpu, cpu)

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
    G.applies(torch.randn(1, 2048, device=CUDA, dtype=torch.bfloat16), w, None)
    ours, cublas = G.timings_us[(4096, 2048, torch.bfloat16, False)]
    print(f"\n[gemv 4096x2048 bf16] ours {ours:.1f} µs, cuBLAS {cublas:.1f} µs")
    assert ours > 0 and cublas > 0


@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "eager"])
def test_engine_with_every_batch1_linear_on_the_gemv_matches_hf(tmp_path, monkeypatch, eager):
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.engine.request import SamplingParams
    from tests.hf_reference import hf_greedy

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.1, tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(tmp_path, safe_serialization=True)
    used = []

    def always(x, weight, bias):  # whatever the timing says: this test is about the numbers
        used.append(weight.shape)
        return x.shape[0] == 1 and weight.shape[1] % G.K_MULTIPLE == 0

    monkeypatch.setattr(G, "applies", always)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cuda", block_size=4, num_kv_blocks=256,
                                    enforce_eager=eager))
    prompt = torch.randint(3, 512, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    got = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert got == hf_greedy(str(tmp_path), prompt, 10)[0]
    assert {(512, 1024), (512, 512), (2048, 512), (768, 512)} <= set(used)  # down, o, gate_up, qkv

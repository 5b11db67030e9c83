"""The CPU's C kernels of the decoder layer's small bf16 ops (common/engine/cpu_ops.py) against the torch path
(kernels/reference.py), which rounds to bf16 where Hugging Face does.

Tolerance: one bf16 rounding of the result (rtol 2^-7) and 1e-2 absolute for values of unit scale: the kernels round
where torch does, so they differ only where a float32 sum in another order (the norm's mean of squares) or exp's
last bits (SiLU) land on the other side of a bf16 rounding. Sums of two bf16 values (the residual) are exact."""
from __future__ import annotations

import pytest
import torch

from common.engine import cpu_ops
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.kernels import reference
from common.engine.request import SamplingParams

BF16 = torch.bfloat16
ONE_ROUNDING = dict(rtol=2**-7, atol=1e-2)

pytestmark = pytest.mark.skipif(cpu_ops._lib() is None, reason="no C compiler for the CPU kernels")


@pytest.mark.parametrize("shape", [(1, 576), (3, 577), (17, 7), (2, 5, 64)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_kernel_equals_torch(shape, with_residual, one_thread):
    torch.manual_seed(0)
    x, residual = torch.randn(shape, dtype=BF16), torch.randn(shape, dtype=BF16) if with_residual else None
    weight = torch.randn(shape[-1], dtype=BF16)
    assert cpu_ops.norm_applies(x, weight)
    out, total = cpu_ops.add_rms_norm(x, residual, weight, 1e-5)
    if with_residual:
        want, want_total = reference.add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(total, want_total)
    else:
        want, want_total = reference.rms_norm(x, weight, 1e-5), x
        assert total is x
    assert out.shape == x.shape and out.dtype == BF16
    torch.testing.assert_close(out, want, **ONE_ROUNDING)


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (5, 2 * 771), (3, 2), (2, 3, 2 * 9)])
def test_silu_and_mul_kernel_equals_torch(shape, one_thread):
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=BF16) * 4  # far into both tails of the sigmoid
    x[0, ..., 0] = -100.0  # exp(100) past float32's range: silu is -0
    got, want = cpu_ops.silu_and_mul(x), reference.silu_and_mul(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, **ONE_ROUNDING)


@pytest.mark.parametrize("heads", [(9, 3, 64), (6, 2, 34), (4, 4, 2)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_kv_kernel_equals_torch(heads, qk_norm, one_thread):
    """Tokens at scattered positions, one with no slot (-1: not written); q and the whole cache compared, so K/V
    land at their slots and nowhere else. With Qwen3's per-head norms (different eps for q and k)."""
    torch.manual_seed(2)
    hq, hkv, d = heads
    qkv = torch.randn(5, (hq + 2 * hkv) * d, dtype=BF16)
    positions = torch.tensor([0, 7, 3, 100, 55])
    cos_sin = torch.randn(128, d, dtype=BF16)
    slots = torch.tensor([3, -1, 9, 0, 17])
    norms = ((torch.randn(d, dtype=BF16), 1e-6), (torch.randn(d, dtype=BF16), 1e-5)) if qk_norm else (None, None)
    cache = torch.randn(2, 5, 4, hkv, d, dtype=BF16)
    mine, theirs = cache.clone(), cache.clone()
    assert cpu_ops.rope_store_applies(qkv, mine[0], cos_sin, norms)
    q = cpu_ops.rope_store_kv(qkv, positions, cos_sin, mine[0], mine[1], slots, hq, hkv, d, *norms)
    want = reference.rope_store_kv(qkv, positions, cos_sin, theirs[0], theirs[1], slots, hq, hkv, d, *norms)
    torch.testing.assert_close(q, want, **ONE_ROUNDING)
    torch.testing.assert_close(mine, theirs, **ONE_ROUNDING)
    assert torch.equal(mine[1], theirs[1])  # V is copied as it is


def test_kernels_take_bf16_on_one_thread_only(one_thread):
    """Float32 stays on torch's ops (Hugging Face's arithmetic, which greedy float32 must equal); so does more than
    one thread, an FP8 cache and a tensor-parallel rank's slice of the heads."""
    x, cache = torch.zeros(2, 64, dtype=BF16), torch.zeros(4, 4, 2, 8, dtype=BF16)
    assert cpu_ops.applies(x) and cpu_ops.rope_store_applies(x, cache)
    assert not cpu_ops.applies(x.float())
    assert not cpu_ops.rope_store_applies(x, cache.to(torch.float8_e4m3fn))
    assert not cpu_ops.rope_store_applies(x, cache[..., :1, :])
    torch.set_num_threads(2)
    assert not cpu_ops.applies(x)


@pytest.mark.parametrize("family", ["llama-gqa", "qwen3-qknorm"])
def test_bf16_engine_with_the_kernels_generates_as_without(tiny_model_dirs, family, monkeypatch, one_thread):
    """Greedy bf16 through the whole engine (prefill chunks and decodes of two sequences): the same tokens with the
    C kernels (every one of them called) as with torch's ops."""
    path = tiny_model_dirs[family]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (13, 6)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    calls = {name: 0 for name in ("add_rms_norm", "rope_store_kv", "silu_and_mul")}
    for name in calls:
        def counted(*args, _name=name, _kernel=getattr(cpu_ops, name)):
            calls[_name] += 1
            return _kernel(*args)
        monkeypatch.setattr(cpu_ops, name, counted)
    config = EngineConfig(model=path, dtype="bfloat16", block_size=4, num_kv_blocks=64)
    with_kernels = LLMEngine(config).generate(prompts, greedy)
    assert all(calls.values()), calls
    monkeypatch.setattr(cpu_ops, "applies", lambda x: False)
    assert LLMEngine(config).generate(prompts, greedy) == with_kernels

"""Each Triton kernel of common/engine/kernels against its torch reference, on fresh random inputs.
Skipped without a CUDA GPU and triton. `python -m pytest -q -s tests/gpu` prints the relative errors."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from common.engine.kernels import reference, triton_ops  # noqa: E402

CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16]
# fp32: the same arithmetic in another order; bf16: a one-ulp rounding flip now and then.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert not got.isnan().any()
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


def _randn(*shape, dtype, gen) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=CUDA).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,hidden", [(1, 2048), (64, 3072), (7, 896), (3, 80)])
def test_add_rms_norm_matches_the_reference(rows, hidden, dtype):
    gen = torch.Generator(CUDA).manual_seed(rows * hidden)
    x, res = _randn(rows, hidden, dtype=dtype, gen=gen), _randn(rows, hidden, dtype=dtype, gen=gen)
    w = _randn(hidden, dtype=dtype, gen=gen)
    out, total = triton_ops.add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_total = reference.add_rms_norm(x, res, w, 1e-5)
    plain = triton_ops.rms_norm(x, w, 1e-5)
    errors = (_rel(out, ref_out), _rel(plain, reference.rms_norm(x, w, 1e-5)))
    print(f"\n[add_rms_norm {rows}x{hidden} {dtype}] rel error {errors[0]:.2e}, plain norm {errors[1]:.2e}")
    assert torch.equal(total, ref_total)  # one rounding of one add: exact
    assert max(errors) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,inter", [(1, 8192), (64, 8192), (5, 4864), (2, 100)])
def test_silu_and_mul_matches_the_reference(rows, inter, dtype):
    gen = torch.Generator(CUDA).manual_seed(rows + inter)
    x = _randn(rows, 2 * inter, dtype=dtype, gen=gen) * 3
    err = _rel(triton_ops.silu_and_mul(x), reference.silu_and_mul(x))
    print(f"\n[silu_and_mul {rows}x{inter} {dtype}] rel error {err:.2e}")
    assert err < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qwen3-norms"])
@pytest.mark.parametrize("heads", [(32, 8, 64), (24, 8, 128), (14, 2, 64), (4, 1, 80)],
                         ids=["llama1b", "llama3b", "qwen0.5b", "mqa-d80"])
def test_rope_store_kv_matches_the_reference(heads, qk_norm, dtype):
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator(CUDA).manual_seed(num_heads * head_dim + qk_norm)
    T, num_blocks, block_size, max_pos = 37, 64, 16, 4096
    qkv = _randn(T, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen)
    positions = torch.randint(0, max_pos, (T,), generator=gen, device=CUDA)
    cos_sin = _randn(max_pos, head_dim, dtype=dtype, gen=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=CUDA)[:T]
    slots[::5] = -1  # padded rows of a CUDA graph: nothing stored
    norms = [(_randn(head_dim, dtype=dtype, gen=gen), 1e-6) for _ in range(2)] if qk_norm else [None, None]
    cache = _randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    ref_cache = cache.clone()
    q = triton_ops.rope_store_kv(qkv, positions, cos_sin, cache[0], cache[1], slots, num_heads, num_kv_heads,
                                 head_dim, *norms)
    ref_q = reference.rope_store_kv(qkv, positions, cos_sin, ref_cache[0], ref_cache[1], slots, num_heads,
                                    num_kv_heads, head_dim, *norms)
    q_err, cache_err = _rel(q, ref_q), _rel(cache, ref_cache)
    print(f"\n[rope_store_kv {heads} norms={qk_norm} {dtype}] rel error q {q_err:.2e}, cache {cache_err:.2e}")
    assert q_err < REL_TOL[dtype] and cache_err < REL_TOL[dtype]
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=CUDA)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(cache.flatten(1, 2)[:, untouched], ref_cache.flatten(1, 2)[:, untouched])
    v_rows = qkv[:, (num_heads + num_kv_heads) * head_dim:].reshape(T, num_kv_heads, head_dim)
    kept = slots >= 0
    assert torch.equal(cache[1].flatten(0, 1)[slots[kept]], v_rows[kept])  # V is copied, bit for bit

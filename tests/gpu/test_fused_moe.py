"""The fused MoE Triton path (kernels/fused_moe.py) against the torch path of models/moe.py on a GPU: routing, the
block's sums in bf16 and fp32 at Qwen3-30B-A3B's expert shape and a small one, inside a CUDA graph, split across
tensor-parallel ranks, the timed choice, and tiny Qwen3-MoE / Mixtral engines forced onto it equal to HF greedy.
Skipped without a CUDA GPU and triton. `python -m pytest -q -s tests/gpu/test_fused_moe.py` prints the errors."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import LLMEngine  # noqa: E402
from common.engine.kernels import fused_moe as F  # noqa: E402
from common.engine.models import moe  # noqa: E402
from common.engine.models.sharding import ExpertColumns, shard_state  # noqa: E402
from common.engine.parallel import TensorParallel  # noqa: E402
from common.engine.request import SamplingParams  # noqa: E402
from tests.hf_reference import hf_greedy  # noqa: E402

CUDA = torch.device("cuda")
# (experts, hidden, intermediate, top-k): Qwen3-30B-A3B's, its TP=4 shard, and a small Mixtral-like one
SHAPES = {"30b-a3b": (128, 2048, 768, 8), "30b-a3b-tp4": (128, 2048, 192, 8), "small": (8, 256, 80, 2)}
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # bf16: the weighted rows are rounded before the k-sum


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert not got.isnan().any()
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


def _case(shape: str, tokens: int, dtype: torch.dtype, seed: int = 0):
    E, H, I, k = SHAPES[shape]
    gen = torch.Generator(CUDA).manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=gen, device=CUDA) / H ** 0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=gen, device=CUDA) / I ** 0.5).to(dtype)
    x = torch.randn(tokens, H, generator=gen, device=CUDA).to(dtype)
    logits = torch.randn(tokens, E, generator=gen, device=CUDA)  # float32: no bf16 ties for top-k to break apart
    return x, logits, gate_up, down, k


@pytest.mark.parametrize("renormalize", [False, True], ids=["qwen3-moe", "norm-topk-and-mixtral"])
@pytest.mark.parametrize("tokens", [1, 37, 512])
def test_routing_picks_the_torch_routes_experts_and_weights(tokens, renormalize):
    _, logits, _, _, k = _case("30b-a3b", tokens, torch.bfloat16)
    weights, ids = F.route(logits, k, renormalize)
    want_weights, want_ids = moe.route(logits, k, renormalize)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 3, 64, 300, 2048])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_fused_block_matches_the_torch_path(shape, tokens, dtype):
    x, logits, gate_up, down, k = _case(shape, tokens, dtype)
    got = F.fused_moe(x, logits, gate_up, down, k, True)
    weights, ids = moe.route(logits, k, True)
    want = moe.looped_experts(x.double(), gate_up.double(), down.double(), ids, weights)
    torch_path = moe.run_experts(x, gate_up, down, ids, weights)
    errors = _rel(got, want), _rel(torch_path, want)
    print(f"\n[fused moe {shape} T={tokens} {dtype}] rel error {errors[0]:.2e} (torch path {errors[1]:.2e})")
    assert errors[0] < REL_TOL[dtype]


def test_a_cuda_graph_replays_the_fused_block_on_new_routes():
    x, logits, gate_up, down, k = _case("30b-a3b", 4, torch.bfloat16)
    torch.cuda.synchronize()
    F.fused_moe(x, logits, gate_up, down, k, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = F.fused_moe(x, logits, gate_up, down, k, True)
    for seed in (1, 2):
        new_x, new_logits, *_ = _case("30b-a3b", 4, torch.bfloat16, seed)
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        assert torch.equal(out, F.fused_moe(x, logits, gate_up, down, k, True))


def test_tensor_parallel_shards_sum_to_the_whole_block():
    x, logits, gate_up, down, k = _case("30b-a3b", 24, torch.float32)
    state = {"e.gate_up_proj": gate_up, "e.down_proj": down}
    shards = [shard_state(state, {"e": ExpertColumns()}, TensorParallel(rank, 4)) for rank in range(4)]
    summed = sum(F.fused_moe(x, logits, s["e.gate_up_proj"].contiguous(), s["e.down_proj"].contiguous(), k, True)
                 for s in shards)
    assert _rel(summed, F.fused_moe(x, logits, gate_up, down, k, True)) < 1e-5


def test_applies_times_both_paths_once_per_token_bucket(monkeypatch):
    monkeypatch.setattr(F, "choices", {})
    x, _, gate_up, down, k = _case("30b-a3b", 5, torch.bfloat16)
    spec = moe.MoeSpec(gate_up.shape[0], k, down.shape[2], True)
    uses = moe._fused_applies(x, gate_up, down, spec)
    (key, choice), = F.choices.items()
    print(f"\n[fused moe choice at T≤{key[0]}, in a CUDA graph] triton {choice.fused_us:.1f} µs, "
          f"torch {choice.torch_us:.1f} µs")
    assert key[0] == 8 and choice.fused_us > 0 and choice.torch_us > 0 and uses == choice.uses_fused
    assert moe._fused_applies(x[:7], gate_up, down, spec) == uses and len(F.choices) == 1  # the same bucket
    monkeypatch.setattr(F, "IMPL", "torch")
    assert not moe._fused_applies(x, gate_up, down, spec)
    monkeypatch.setattr(F, "IMPL", "triton")
    assert moe._fused_applies(x, gate_up, down, spec)


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_a_moe_engine_on_the_fused_path_decodes_hfs_greedy_tokens(tiny_model_dirs, family, monkeypatch):
    """fp32, CUDA graphs for decode, chunked prefills: every sparse block runs the Triton kernels."""
    monkeypatch.setattr(F, "IMPL", "triton")
    calls = []
    fused_moe = F.fused_moe
    monkeypatch.setattr(F, "fused_moe", lambda *a: calls.append(a[0].shape[0]) or fused_moe(*a))
    path = tiny_model_dirs[family]
    engine = LLMEngine(EngineConfig(model=path, device="cuda", block_size=4, num_kv_blocks=256,
                                    max_num_batched_tokens=16))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 11, 40)]
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert calls and engine.runner.graphs is not None
    for prompt, got in zip(prompts, outputs):
        assert got == hf_greedy(path, prompt, 12)[0]

"""The MoE families (Qwen3-MoE, Mixtral): routing as transformers routes, the three expert paths give the same
sums, checkpoints with per-expert or stacked expert names load alike, and tensor parallelism, chunked prefill,
the prefill→decode handoff and the prefix cache keep greedy output equal to Hugging Face. (Aggregated greedy
parity, the one-thread CPU path and async scheduling run for them in the per-family tests: tests/tiny_models.py.)"""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.models.loader import load_model
from common.engine.models.moe import dense_experts, grouped_experts, looped_experts, route
from common.engine.models.moe_decoder import stack_experts
from common.engine.models.sharding import ExpertColumns, shard_state
from common.engine.parallel import TensorParallel
from common.engine.request import SamplingParams
from common.errors import InvalidConfig
from tests.hf_reference import hf_greedy, hf_model
from tests.unit.test_kv_handoff import _decode, _prefill

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
MOE_FAMILIES = ["qwen3-moe", "mixtral"]


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("router", [
    Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False)),
    Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True)),
    MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2)),
], ids=["qwen3-moe", "qwen3-moe-norm-topk", "mixtral"])
def test_routing_picks_and_weighs_experts_as_transformers(router):
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        x = torch.randn(32, 16)
        _, want_weights, want_ids = router(x)
        renormalize = getattr(router, "norm_topk_prob", True)
        weights, ids = route(torch.nn.functional.linear(x, router.weight), router.top_k, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights.float())


def _experts_case():
    """Random experts and routing (10 picks of 8 experts: some get none), and each token's sum written out."""
    torch.manual_seed(1)
    experts, hidden, inter, tokens, k = 8, 16, 8, 5, 2
    gate_up, down = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    x = torch.randn(tokens, hidden)
    weights, ids = route(torch.randn(tokens, experts), k, True)
    want = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(k):
            gate, up = (gate_up[ids[t, j]] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (down[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    return (x, gate_up, down, ids, weights), want


@pytest.mark.parametrize("experts", [looped_experts, dense_experts])
def test_expert_paths_give_the_sums_of_each_tokens_experts(experts):
    args, want = _experts_case()
    torch.testing.assert_close(experts(*args), want, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 9), reason="no CPU grouped GEMM")
def test_the_gpu_grouped_gemm_path_gives_the_same_sums_on_torchs_cpu_kernel():
    args, want = _experts_case()
    torch.testing.assert_close(grouped_experts(*args), want, rtol=1e-5, atol=1e-4)


def test_stacked_expert_names_load_as_the_per_expert_ones(tiny_model_dirs, tmp_path):
    """save_pretrained writes `experts.{e}.gate_proj` …; transformers' in-memory (and some checkpoints') names are
    the stacked `experts.gate_up_proj` / `experts.down_proj`: both load to the same weights."""
    path = tiny_model_dirs["qwen3-moe"]
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    saved = {k: v.contiguous() for k, v in hf_model(path).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in saved and not any(".experts.0." in k for k in saved)
    save_file(saved, tmp_path / "model.safetensors")
    per_expert, _ = load_model(path, torch.float32, torch.device("cpu"))
    stacked, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    for (name, a), (_, b) in zip(per_expert.state_dict().items(), stacked.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_checkpoint_missing_an_expert_is_refused_by_name():
    state = {f"layers.0.mlp.experts.{e}.{n}.weight": torch.zeros(2, 2) for e in (0, 2)
             for n in ("gate_proj", "up_proj", "down_proj")}
    with pytest.raises(InvalidConfig, match=r"layers.0.mlp.experts lacks some of its 3 experts"):
        stack_experts(state, ("gate_proj", "up_proj", "down_proj"))


def test_expert_shards_reassemble_into_the_checkpoint():
    experts, hidden, inter = 3, 4, 6
    gate_up, down = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    state = {"layers.0.mlp.experts.gate_up_proj": gate_up, "layers.0.mlp.experts.down_proj": down}
    shards = [shard_state(state, {"mlp.experts": ExpertColumns()}, TensorParallel(rank, 2)) for rank in range(2)]
    halves = [s["layers.0.mlp.experts.gate_up_proj"].chunk(2, dim=1) for s in shards]  # each rank: gate ‖ up
    for part in range(2):
        assert torch.equal(torch.cat([h[part] for h in halves], dim=1), gate_up.chunk(2, dim=1)[part])
    assert torch.equal(torch.cat([s["layers.0.mlp.experts.down_proj"] for s in shards], dim=-1), down)


class _EnginesByTp(dict):
    """{tp size: engine}, each started on first use: the TP=1 tests start no follower rank."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def __missing__(self, tp: int) -> LLMEngine:
        self[tp] = LLMEngine(EngineConfig(model=self.path, tensor_parallel_size=tp, block_size=4, num_kv_blocks=64,
                                          long_prefill_token_threshold=8))
        return self[tp]


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_engines(request, tiny_model_dirs):
    """(model dir, {tp size: engine}) at TP 1 and 2, prompts over 8 tokens prefilled in chunks."""
    path = tiny_model_dirs[request.param]
    engines = _EnginesByTp(path)
    yield path, engines
    for engine in engines.values():
        engine.close()


@pytest.mark.slow  # a follower rank is a process
def test_tp2_with_chunked_prefill_equals_hf(moe_engines):
    path, engines = moe_engines
    prompts = _prompts([5, 23])
    assert engines[2].generate(prompts, GREEDY) == [hf_greedy(path, p, 10)[0] for p in prompts]
    assert engines[2].block_manager.num_free_blocks == 64


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow),
                                                    pytest.param(1, 2, marks=pytest.mark.slow)])  # slow: a rank process
def test_a_session_prefilled_at_one_tp_size_decodes_at_another(moe_engines, prefill_tp, decode_tp):
    path, engines = moe_engines
    prompt = _prompts([19], seed=5)[0]
    prefill, decode = engines[prefill_tp], engines[decode_tp]
    out = _prefill(prefill, prompt)
    kv = prefill.export_session(out.session_id)
    prefill.release_session(out.session_id)
    assert _decode(decode, prompt, out.new_token_ids[0], kv) == hf_greedy(path, prompt, 10)[0]
    assert prefill.block_manager.num_free_blocks == decode.block_manager.num_free_blocks == 64


def test_a_prefix_cache_hit_matches_hf(moe_engines):
    path, engines = moe_engines
    shared = _prompts([16], seed=2)[0]
    engine = engines[1]
    engine.generate([shared + [5, 6, 7]], GREEDY)
    request = engine.add_request("hit", shared + [8, 9], GREEDY)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    assert request.num_cached_tokens == 16
    assert tokens == hf_greedy(path, shared + [8, 9], 10)[0]

"""The fused MoE Triton kernels (kernels/fused_moe.py) on CPU tensors in Triton's interpreter, against the torch
reference: routing as models/moe.route routes for Qwen3-MoE (norm_topk_prob false / true) and Mixtral (which
tests/unit/test_moe.py checks against transformers' routers), the expert-sorted layout, and the block's sums
(looped_experts) over token counts of 1 and ones no multiple of BLOCK_M, with an expert that gets no token (and at
one token, most get none), whole and split across two tensor-parallel ranks. float32: the interpreter has no bf16
(tests/gpu/test_fused_moe.py checks bf16 against the torch path on a GPU). One subprocess runs every case: the
interpreter must be on before triton is imported."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_CASES = """
import json
import torch
from common.engine.kernels import fused_moe as F
from common.engine.models.moe import looped_experts, route
from common.engine.models.sharding import ExpertColumns, shard_state
from common.engine.parallel import TensorParallel

torch.manual_seed(0)
E, H, I = 8, 32, 24
out = {"route": {}, "align": {}, "experts": {}}
families = {"qwen3-moe": (3, False), "qwen3-moe-norm-topk": (3, True), "mixtral": (2, True)}  # (k, renormalize)
gate_up, down = torch.randn(E, 2 * I, H) / H ** 0.5, torch.randn(E, H, I) / I ** 0.5
with torch.no_grad():
    for family, (k, renormalize) in families.items():
        for T in (1, 5, 20):
            x, logits = torch.randn(T, H), torch.randn(T, E) * 3
            logits[:, 5] = -100.0  # expert 5 gets no token
            weights, ids = F.route(logits, k, renormalize)
            want_weights, want_ids = route(logits, k, renormalize)
            out["route"][f"{family}/{T}"] = [torch.equal(ids.long(), want_ids),
                                             (weights - want_weights).abs().max().item()]
            want = looped_experts(x, gate_up, down, want_ids, want_weights)
            tiles = [None] + ([F.MoeTile(16, 16, 16, 16, 4, 1), F.MoeTile(32, 32, 64, 32, 4, 1)] if T == 20 else [])
            for tile in tiles:  # the default, then K a multiple of BLOCK_K (16) and not (64)
                got = F.fused_experts(x, gate_up, down, ids, weights, tile)
                name = "default" if tile is None else f"{tile.block_m}x{tile.block_k}"
                out["experts"][f"{family}/{T}/{name}"] = (got - want).abs().max().item()
            for block_m in (16, 32) if T == 20 else (16,):
                layout = F.align(ids, E, block_m)
                used, pairs = layout.used.item(), layout.pairs[:layout.used.item()].long()
                real = pairs[pairs < T * k]
                block_of = layout.block_expert[:used // block_m].long().repeat_interleave(block_m)
                flat = ids.flatten().long()
                counts = torch.bincount(flat, minlength=E)
                out["align"][f"{family}/{T}/{block_m}"] = (
                    counts[5] == 0 and layout.pairs.numel() == F.capacity(T * k, E, block_m)
                    and used == int(((counts + block_m - 1) // block_m * block_m).sum())
                    and torch.equal(real.sort().values, torch.arange(T * k))  # each pair once
                    and torch.equal(block_of[pairs < T * k], flat[real])  # in its expert's blocks
                    and bool((block_of[1:] >= block_of[:-1]).all()))  # experts in order
    shards = [shard_state({"e.gate_up_proj": gate_up, "e.down_proj": down}, {"e": ExpertColumns()},
                          TensorParallel(rank, 2)) for rank in range(2)]
    x, logits = torch.randn(7, H), torch.randn(7, E)
    summed = sum(F.fused_moe(x, logits, s["e.gate_up_proj"], s["e.down_proj"], 2, True) for s in shards)
    out["tp"] = (summed - looped_experts(x, gate_up, down, *route(logits, 2, True)[::-1])).abs().max().item()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    result = subprocess.run([sys.executable, "-c", _CASES], env={**os.environ, "TRITON_INTERPRET": "1"},
                            cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_routing_picks_and_weighs_experts_as_each_familys_torch_routing(interpreted):
    assert len(interpreted["route"]) == 9
    for case, (same_ids, weight_error) in interpreted["route"].items():
        assert same_ids and weight_error < 1e-6, case


def test_the_sorted_layout_holds_each_pair_once_in_its_experts_padded_blocks(interpreted):
    assert len(interpreted["align"]) == 12 and all(interpreted["align"].values()), interpreted["align"]


def test_the_fused_block_gives_the_torch_references_sums(interpreted):
    """Every family and token count, through the default tile and ones with K a multiple of BLOCK_K or not."""
    assert len(interpreted["experts"]) == 15
    for case, error in interpreted["experts"].items():
        assert error < 1e-5, case


def test_tensor_parallel_shards_sum_to_the_whole_block(interpreted):
    """Each rank's experts hold a slice of the intermediate columns (ExpertColumns); their outputs add up."""
    assert interpreted["tp"] < 1e-5

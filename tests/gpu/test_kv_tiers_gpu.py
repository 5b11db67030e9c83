"""The KV cache tiers on a GPU: blocks the device pool evicts go through pinned host memory to disk and come back
up, with CUDA graphs and async scheduling on, and greedy tokens stay those of a run without tiers."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.unit.test_kv_tiers_engine import BLOCKS, _chat, _engine, _prompts, _total  # noqa: E402


@pytest.fixture(scope="module")
def baseline(tiny_llama) -> list[list[int]]:
    return _chat(_engine(tiny_llama, device="cuda"))


def _block_bytes(engine) -> int:
    return engine.runner.kv_cache.view(torch.uint8)[:, :, 0].numel()


def test_pinned_host_and_disk_tiers_serve_hits_with_the_same_greedy_tokens(tiny_llama, baseline, tmp_path):
    probe = _engine(tiny_llama, device="cuda")
    host_gb = 15 * _block_bytes(probe) / (1 << 30)
    engine = _engine(tiny_llama, device="cuda", host_kv_cache_gb=host_gb, disk_kv_cache_dir=str(tmp_path / "kv"),
                     disk_kv_cache_gb=0.01)
    assert engine.async_scheduling and engine.kv_tiers.host.slab.is_pinned()
    assert _chat(engine, turns=1) == baseline[:6]
    assert _chat(engine, turns=1, prompts=_prompts()[::-1]) == baseline[:6][::-1]
    for tier in ("host", "disk"):
        assert _total(engine, "disagg_kv_tier_hit_blocks_total", tier=tier) > 0, tier
    assert engine.block_manager.num_free_blocks == BLOCKS
    engine.close()


def test_a_disk_tier_alone_on_a_gpu_gives_the_same_greedy_tokens(tiny_llama, baseline, tmp_path):
    engine = _engine(tiny_llama, device="cuda", disk_kv_cache_dir=str(tmp_path / "kv"), disk_kv_cache_gb=0.01)
    assert _chat(engine) == baseline
    assert _total(engine, "disagg_kv_tier_hit_tokens_total", tier="disk") == 6 * 9 * 4
    engine.close()

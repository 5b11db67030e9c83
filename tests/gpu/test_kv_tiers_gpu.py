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


def test_host_tier_blocks_go_up_from_pinned_copies_and_disk_ones_gathered_beside_them():
    from benchmarks.kv_tier_bandwidth import DevicePaths, layout_of

    paths = DevicePaths(layout_of(None, 1 << 16), 4, torch.device("cuda"), batch=4)
    try:
        paths.offload()
        tiers, keys = paths.tiers, paths.keys
        assert tiers.host.slab.is_pinned() and tiers.host.get(keys[0].hash).payload.is_pinned()
        fetched = tiers.fetch("r", keys, limit=4)
        disk_like = fetched[2].payload.clone()  # pageable, as a block read from a file is
        assert not disk_like.is_pinned()
        fetched[2] = type(fetched[2])(fetched[2].key, disk_like, fetched[2].checksum, "disk")
        tiers.install([4, 5, 6, 7], fetched)
        torch.cuda.synchronize()
        assert paths.onboarded_intact()
    finally:
        paths.close()


def test_the_bandwidth_bench_times_offload_and_onboard_on_a_gpu(monkeypatch, capsys, tmp_path):
    import sys

    from benchmarks import kv_tier_bandwidth as bench

    monkeypatch.setattr(sys, "argv", ["kv_tier_bandwidth", "--dir", str(tmp_path), "--blocks", "8", "--shape",
                                      "llama-3.2-1b", "--device", "cuda", "--rounds", "1", "--warm", "--batch", "4"])
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "host tier pinned" in out and "(pinned host -> device copy)" in out


def test_offload_and_onboard_do_not_wait_for_the_step_in_flight():
    from benchmarks.kv_tier_bandwidth import DevicePaths, layout_of

    paths = DevicePaths(layout_of(None, 1 << 16), 4, torch.device("cuda"), batch=4)
    try:
        paths.offload()
        tiers, keys = paths.tiers, paths.keys
        fetched = tiers.fetch("r", keys, limit=4)
        torch.cuda.synchronize()
        busy = torch.cuda.Event(enable_timing=False)
        torch.cuda._sleep(2_000_000_000)  # about a second of a step on the engine's stream
        busy.record()
        tiers.install([4, 5, 6, 7], fetched)
        for b in range(4):  # the same blocks down again: out of the host tier, cached on the device
            tiers.host.discard(keys[b].hash)
            tiers.remember(b, keys[b])
        tiers.capture([(b, keys[b].hash) for b in range(4)])
        assert not busy.query(), "install or capture waited for the stream"
        torch.cuda.synchronize()
        tiers.mover.drain()
        assert paths.onboarded_intact() and all(key.hash in tiers.host for key in keys)
    finally:
        paths.close()

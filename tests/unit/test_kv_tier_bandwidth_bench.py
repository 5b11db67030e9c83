"""benchmarks/kv_tier_bandwidth.py on a few small blocks: every path is measured against its limit in one table, the
tier's reads verify what they read, the blocks make one hash chain, and the device paths run the engine's own
offload (KvTiers.capture, the mover's store) and onboard (prefetch, fetch, install) on the CPU."""
import sys

import pytest
import torch

from benchmarks import kv_tier_bandwidth as bench
from common.kv.tiers.record import BlockKey, checksum


def test_the_bench_prints_each_path_beside_its_limit(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["kv_tier_bandwidth", "--dir", str(tmp_path), "--blocks", "4",
                                      "--block-mib", "0.0625", "--rounds", "1", "--warm"])  # the suite's other tests keep their page cache
    assert bench.main() == 0
    out = capsys.readouterr().out
    for path in ("disk tier read + decode + verify", "disk tier write (temp + rename)", "host tier put",
                 "host tier get (a copy out)", "offload: device -> host tier (capture + mover store)",
                 "offload: the engine thread's capture calls",
                 "onboard: host tier -> device (prefetch + fetch + install)",
                 "onboard: the engine thread's fetch + install"):
        line = next(line for line in out.splitlines() if line.startswith(f"| {path} |"))
        ours, limit, ratio = line.split("|")[2:5]
        assert float(ours) > 0 and float(limit.split()[0]) > 0 and ratio.strip().endswith("x")
    assert "4 blocks of 0.0625 MiB" in out and "reads warm (--warm)" in out
    assert "device cpu: a cache of 8 blocks of 0.0625 MiB (1 layers x 8 KV heads x 128" in out
    assert "host tier unpinned" in out and "(bare device -> host copy)" in out


def test_a_shape_sets_the_block_of_every_path(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["kv_tier_bandwidth", "--dir", str(tmp_path), "--blocks", "2", "--shape",
                                      "smollm2-135m", "--rounds", "1", "--warm", "--batch", "1"])
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "2 blocks of 0.351562 MiB" in out  # 30 layers x 2 x 16 tokens x 3 heads x 64 x 2 bytes
    assert "(30 layers x 3 KV heads x 64, bf16, 16 tokens), 1 blocks a capture" in out


@pytest.mark.parametrize("shape, block_mib, layers", [("llama-3.2-3b", 2.0, 28), (None, 2.0, 32), (None, 0.01, 1)])
def test_the_geometry_is_a_shape_or_the_block_mib_in_layers(shape, block_mib, layers):
    layout = bench.layout_of(shape, int(block_mib * (1 << 20)))
    assert layout.num_layers == layers and layout.block_size == 16 and layout.dtype == "bfloat16"


def test_the_device_paths_offload_into_the_host_tier_and_onboard_the_same_bytes():
    paths = bench.DevicePaths(bench.layout_of(None, 1 << 16), 5, torch.device("cpu"), batch=2)
    try:
        assert paths.offload() >= 0
        assert all(key.hash in paths.tiers.host for key in paths.keys)
        assert paths.tiers.metrics.total("disagg_kv_tier_offload_blocks_total", tier="host") == 5
        assert not paths.onboarded_intact()  # (the second half of the cache is other random bytes yet)
        assert paths.onboard() >= 0 and paths.onboarded_intact()
        assert paths.tiers.metrics.total("disagg_kv_tier_hit_blocks_total", tier="host") == 5
        paths.offload()  # again: each round starts from an empty host tier
        assert paths.tiers.metrics.total("disagg_kv_tier_offload_blocks_total", tier="host") == 10
    finally:
        paths.close()


def test_the_blocks_chain_and_carry_their_checksums():
    blocks = bench.blocks(3, 64)
    assert [b.key.parent for b in blocks] == [0, blocks[0].key.hash, blocks[1].key.hash]
    assert all(isinstance(b.key, BlockKey) and b.key.consistent() and b.payload.numel() == 64 for b in blocks)
    assert all(b.checksum == checksum(b.payload) for b in blocks)

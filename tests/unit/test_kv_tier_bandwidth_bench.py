"""benchmarks/kv_tier_bandwidth.py on a few small blocks: every path is measured against its limit in one table, the
tier's reads verify what they read, and the blocks make one hash chain."""
import sys

from benchmarks import kv_tier_bandwidth as bench
from common.kv.tiers.record import BlockKey, checksum


def test_the_bench_prints_each_path_beside_its_limit(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["kv_tier_bandwidth", "--dir", str(tmp_path), "--blocks", "4",
                                      "--block-mib", "0.0625", "--rounds", "1", "--warm"])  # the suite's other tests keep their page cache
    assert bench.main() == 0
    out = capsys.readouterr().out
    for path in ("disk tier read + decode + verify", "disk tier write (temp + rename)", "host tier put",
                 "host tier get (a copy out)"):
        line = next(line for line in out.splitlines() if line.startswith(f"| {path} |"))
        ours, limit, ratio = line.split("|")[2:5]
        assert float(ours) > 0 and float(limit.split()[0]) > 0 and ratio.strip().endswith("x")
    assert "4 blocks of 0.0625 MiB" in out and "reads warm (--warm)" in out


def test_the_blocks_chain_and_carry_their_checksums():
    blocks = bench.blocks(3, 64)
    assert [b.key.parent for b in blocks] == [0, blocks[0].key.hash, blocks[1].key.hash]
    assert all(isinstance(b.key, BlockKey) and b.key.consistent() and b.payload.numel() == 64 for b in blocks)
    assert all(b.checksum == checksum(b.payload) for b in blocks)

"""The KV tiers' bandwidth against the physical limit measured in the same run: the disk tier's reads (read, decode,
verify: what onboarding a block does before the copy into the device) against a plain sequential read of the same
files in the same order, and its writes (header, payload, temp file + rename) against plain writes of as many bytes;
the host tier's put and get against a bare copy of the same bytes (torch's copy_ between the same buffers).

    python -m benchmarks.kv_tier_bandwidth [--dir DIR] [--blocks 256] [--block-mib 2] [--rounds 3]

Blocks are random bytes of --block-mib MiB each (2 MiB: a 16-token block of an 8B-shaped model in bf16). Each
figure is the best of --rounds (the two reads taking turns), cold where the kernel allows dropping the page cache
(run as root with /proc/sys/vm/drop_caches writable), else warm: the line says which.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from common.kv.block_hash import hash_block
from common.kv.tiers.disk import DiskTier
from common.kv.tiers.host import HostTier
from common.kv.tiers.identity import TierLayout
from common.kv.tiers.metrics import TierMetrics
from common.kv.tiers.record import BlockKey, StoredBlock, checksum, decode

LAYOUT = TierLayout(fingerprint="bench", weights="bench", block_size=16, dtype="bfloat16", num_layers=32,
                    num_kv_heads=8, head_dim=128)


def blocks(count: int, nbytes: int) -> list[StoredBlock]:
    made, parent = [], 0
    for i in range(count):
        tokens = tuple(range(i * 16, i * 16 + 16))
        key = BlockKey(hash_block(parent, list(tokens)), parent, tokens)
        payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        made.append(StoredBlock(key, payload, checksum(payload), "disk"))
        parent = key.hash
    return made


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def plain_read(paths: list[Path]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            total += f.readinto(data)
    return total


def plain_write(directory: Path, sizes: list[int]) -> None:
    data = bytearray(max(sizes))
    for i, size in enumerate(sizes):
        with open(directory / f"plain-{i}", "wb") as f:
            f.write(memoryview(data)[:size])


def tier_read(tier: DiskTier, stored: list[StoredBlock], block_bytes: int) -> int:
    total = 0
    for block in stored:
        data = tier.read(block.key.hash)
        got = decode(data, LAYOUT, tier.name)
        got.verify(block.key, block_bytes)
        total += len(data)
    return total


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def best(fn, rounds: int, before=None) -> float:
    return interleaved(fn, rounds=rounds, before=before)[0]


def interleaved(*fns, rounds: int, before=None) -> tuple[float, ...]:
    """Best of `rounds` of each, taking turns (the disk's own speed drifts between runs on a shared machine)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, kept in zip(fns, times):
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - start)
    return tuple(min(kept) for kept in times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=None, help="where the disk tier writes (default: a temporary dir)")
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warm", action="store_true", help="read through the page cache (do not drop it)")
    args = p.parse_args()
    nbytes = int(args.block_mib * (1 << 20))
    stored = blocks(args.blocks, nbytes)
    total = args.blocks * nbytes
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        root = Path(root)
        tier = DiskTier(root / "tier", 4 * total, LAYOUT, TierMetrics())
        write_s = best(lambda: [tier.write(b) for b in stored], args.rounds,
                       before=lambda: [tier.discard(b.key.hash) for b in stored])
        (root / "plain").mkdir()
        sizes = [tier.path(b.key.hash).stat().st_size for b in stored]
        plain_write_s = best(lambda: plain_write(root / "plain", sizes), args.rounds)
        paths = [tier.path(b.key.hash) for b in stored]
        cold = not args.warm and drop_page_cache()
        before = drop_page_cache if cold else None
        plain_s, read_s = interleaved(lambda: plain_read(paths), lambda: tier_read(tier, stored, nbytes),
                                      rounds=args.rounds, before=before)
        on_disk = sum(sizes)

        host = HostTier(int(1.5 * total), nbytes, pin=torch.cuda.is_available())
        put_s = best(lambda: [host.put(b) for b in stored], args.rounds,
                     before=lambda: [host.discard(b.key.hash) for b in stored])
        get_s = best(lambda: [host.get(b.key.hash) for b in stored], args.rounds)
        slab = torch.zeros((args.blocks, nbytes), dtype=torch.uint8)  # touched: no page fault in the timing
        copy_s = best(lambda: [slab[i].copy_(b.payload) for i, b in enumerate(stored)], args.rounds)

    warm = "warm (--warm)" if args.warm else "warm (the page cache could not be dropped)"
    print(f"{args.blocks} blocks of {args.block_mib:g} MiB ({total / 1e9:.2f} GB), best of {args.rounds}; reads "
          f"{'cold (page cache dropped before each)' if cold else warm}")
    print("| path | GB/s | limit GB/s | of the limit |")
    print("| --- | --- | --- | --- |")
    rows = [("disk tier read + decode + verify", gbps(on_disk, read_s), "plain sequential read", gbps(on_disk, plain_s)),
            ("disk tier write (temp + rename)", gbps(on_disk, write_s), "plain write", gbps(on_disk, plain_write_s)),
            ("host tier put", gbps(total, put_s), "bare copy", gbps(total, copy_s)),
            ("host tier get (a copy out)", gbps(total, get_s), "bare copy", gbps(total, copy_s))]
    for name, ours, limit_name, limit in rows:
        print(f"| {name} | {ours:.2f} | {limit:.2f} ({limit_name}) | {ours / limit:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

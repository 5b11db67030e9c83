"""The KV tiers' bandwidth against the physical limit measured in the same run: the disk tier's reads (read, decode,
verify: what onboarding a block does before the copy into the device) against a plain sequential read of the same
files in the same order, and its writes (header, payload, temp file + rename) against plain writes of as many bytes;
the host tier's put and get against a bare copy of the same bytes (torch's copy_ between the same buffers); and the
engine's own offload and onboard between a device KV cache and the host tier (KvTiers: what the block manager calls
when it evicts a cached block and when a prefix hit comes up) against a bare pinned copy of the same bytes.

    python -m benchmarks.kv_tier_bandwidth [--dir DIR] [--blocks 256] [--block-mib 2 | --shape llama-3.2-3b]
        [--device cpu|cuda] [--batch 16] [--rounds 3]

Blocks are random bytes of a 16-token block of --shape (layers, KV heads, head dim, in bf16), or --block-mib MiB
each (2 MiB: a 16-token block of an 8B-shaped model in bf16; its device cache has --block-mib x 16 layers of 8 KV
heads x 128). Each figure is the best of --rounds (the paths beside their limits taking turns), the disk's reads
cold where the kernel allows dropping the page cache (run as root with /proc/sys/vm/drop_caches writable), else
warm: the line says which.

Offload: the device cache's --blocks blocks, each remembered under its key as the prefix cache does, are captured
--batch at a time (KvTiers.capture: the gather on the device, the copy into pinned memory on the engine's stream)
and stored into the host tier by the tiers' mover (checksums, the slab); timed until the mover has stored the
last. The bench waits for room in the mover's queue before each batch (the engine would drop the batch instead).
Onboard: requests of --batch blocks each are prefetched (the mover reads and verifies them from the host tier),
then, as admission does, each one once staged is fetched and installed into fresh device blocks; timed until the
device has them (synchronized), and checked equal to the blocks offloaded. On the CPU the device cache is host
memory and the host tier unpinned (the engine runs no host tier there: this times the same code). The limits: one
copy_ of the same bytes between a device buffer and pinned host memory (non_blocking, synchronized).
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
from common.kv.tiers.stack import KvTiers

LAYOUT = TierLayout(fingerprint="bench", weights="bench", block_size=16, dtype="bfloat16", num_layers=32,
                    num_kv_heads=8, head_dim=128)
SHAPES = {"llama-3.2-1b": (16, 8, 64), "llama-3.2-3b": (28, 8, 128), "llama-3.1-8b": (32, 8, 128),
          "smollm2-135m": (30, 3, 64)}  # layers, KV heads, head dim


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



def layout_of(shape: str | None, block_bytes: int) -> TierLayout:
    """The block geometry: a --shape by name, else --block-mib's bytes as layers of 8 KV heads x 128 in bf16."""
    layers, heads, dim = SHAPES[shape] if shape else (max(1, block_bytes // (2 * 16 * 8 * 128 * 2)), 8, 128)
    return TierLayout(fingerprint="bench", weights="bench", block_size=16, dtype="bfloat16", num_layers=layers,
                      num_kv_heads=heads, head_dim=dim)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DevicePaths:
    """A device KV cache of 2 x `count` blocks of `layout` under KvTiers with a host tier, as open_tiers builds it:
    blocks [0, count) are offloaded, then onboarded into [count, 2 x count)."""

    def __init__(self, layout: TierLayout, count: int, device: torch.device, batch: int):
        self.device, self.count, self.batch = device, count, batch
        cache = torch.empty((layout.num_layers, 2, 2 * count, 16, layout.num_kv_heads, layout.head_dim),
                            dtype=torch.bfloat16, device=device)
        cache.view(torch.uint8).random_(0, 256)
        self.cache_bytes = cache.view(torch.uint8)
        self.block_bytes = self.cache_bytes[:, :, 0].numel()
        pinned = device.type == "cuda"
        host = HostTier(int(1.5 * count * self.block_bytes), self.block_bytes, pin=pinned)
        self.tiers = KvTiers(cache, layout, host, None, TierMetrics(), max_prefetch_blocks=2 * count)
        self.keys = [b.key for b in blocks(count, 0)]
        self.pinned = torch.empty((count, self.block_bytes), dtype=torch.uint8, pin_memory=pinned)
        self.flat = torch.empty((count, self.block_bytes), dtype=torch.uint8, device=device)

    @property
    def nbytes(self) -> int:
        return self.count * self.block_bytes

    def offload(self) -> float:
        """Seconds the engine thread spent in capture; the blocks are in the host tier on return."""
        tiers, host, n = self.tiers, self.tiers.host, self.count
        for i, key in enumerate(self.keys):
            host.discard(key.hash)
            tiers.remember(i, key)  # (the prefix cache's commit)
        sync(self.device)
        engine_s = 0.0
        for i in range(0, n, self.batch):
            ids = range(i, min(i + self.batch, n))
            while not tiers.mover.has_room(len(ids) * self.block_bytes):
                time.sleep(50e-6)
            start = time.perf_counter()
            tiers.capture([(b, self.keys[b].hash) for b in ids])
            engine_s += time.perf_counter() - start
        tiers.mover.drain()
        stored = sum(key.hash in host for key in self.keys)
        if stored != n:
            raise RuntimeError(f"offload stored {stored} of {n} blocks")
        return engine_s

    def onboard(self) -> float:
        """Seconds the engine thread spent fetching and installing; the device holds the blocks on return."""
        tiers, n = self.tiers, self.count
        runs = [(f"bench-{i}", self.keys[i:i + self.batch], list(range(n + i, n + min(i + self.batch, n))))
                for i in range(0, n, self.batch)]
        sync(self.device)
        for request_id, keys, _ in runs:
            tiers.prefetch(request_id, keys)  # (as each request is queued)
        engine_s = 0.0
        for request_id, keys, ids in runs:
            while not tiers.ready(request_id):  # (admission passes it over until its blocks are staged)
                time.sleep(50e-6)
            start = time.perf_counter()
            fetched = tiers.fetch(request_id, keys, limit=len(keys))
            if len(fetched) != len(keys):
                raise RuntimeError(f"onboard found {len(fetched)} of {len(keys)} blocks")
            tiers.install(ids, fetched)
            engine_s += time.perf_counter() - start
        sync(self.device)
        return engine_s

    def onboarded_intact(self) -> bool:
        n = self.count
        return torch.equal(self.cache_bytes[:, :, n:], self.cache_bytes[:, :, :n])

    def copy_down(self) -> None:
        self.pinned.copy_(self.flat, non_blocking=True)
        sync(self.device)

    def copy_up(self) -> None:
        self.flat.copy_(self.pinned, non_blocking=True)
        sync(self.device)

    def close(self) -> None:
        self.tiers.close()


def device_rows(paths: DevicePaths, rounds: int) -> list[tuple[str, float, str, float]]:
    """The offload and onboard rows (GB/s, end to end and the engine thread's share) beside the bare copies."""
    engine = {"offload": [], "onboard": []}

    def timed(name):
        return lambda: engine[name].append(getattr(paths, name)())

    paths.copy_down(), paths.copy_up(), paths.offload(), paths.onboard()  # (warm: allocators, pinned pages)
    down_s, offload_s, up_s, onboard_s = interleaved(paths.copy_down, timed("offload"), paths.copy_up,
                                                     timed("onboard"), rounds=rounds)
    if not paths.onboarded_intact():
        raise RuntimeError("the onboarded blocks differ from those offloaded")
    where = "pinned" if paths.device.type == "cuda" else "bare"
    total, down, up = paths.nbytes, gbps(paths.nbytes, down_s), gbps(paths.nbytes, up_s)
    return [("offload: device -> host tier (capture + mover store)", gbps(total, offload_s),
             f"{where} device -> host copy", down),
            ("offload: the engine thread's capture calls", gbps(total, min(engine["offload"])),
             f"{where} device -> host copy", down),
            ("onboard: host tier -> device (prefetch + fetch + install)", gbps(total, onboard_s),
             f"{where} host -> device copy", up),
            ("onboard: the engine thread's fetch + install", gbps(total, min(engine["onboard"])),
             f"{where} host -> device copy", up)]

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=None, help="where the disk tier writes (default: a temporary dir)")
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="a model's block geometry (16 tokens, bf16) instead of --block-mib")
    p.add_argument("--device", default="cpu", help="where the device KV cache lives: cpu, cuda, cuda:N")
    p.add_argument("--batch", type=int, default=16, help="blocks a capture (offload) and a request (onboard)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warm", action="store_true", help="read through the page cache (do not drop it)")
    args = p.parse_args()
    layout = layout_of(args.shape, int(args.block_mib * (1 << 20)))
    nbytes = layout.num_layers * 2 * 16 * layout.num_kv_heads * layout.head_dim * 2 if args.shape else \
        int(args.block_mib * (1 << 20))
    device = torch.device(args.device)
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
    del stored, slab, host
    on_device = DevicePaths(layout, args.blocks, device, args.batch)
    try:
        moved = device_rows(on_device, args.rounds)
    finally:
        on_device.close()

    warm = "warm (--warm)" if args.warm else "warm (the page cache could not be dropped)"
    print(f"{args.blocks} blocks of {nbytes / (1 << 20):g} MiB ({total / 1e9:.2f} GB), best of {args.rounds}; reads "
          f"{'cold (page cache dropped before each)' if cold else warm}")
    print(f"device {device}: a cache of {2 * args.blocks} blocks of {on_device.block_bytes / (1 << 20):g} MiB "
          f"({layout.num_layers} layers x {layout.num_kv_heads} KV heads x {layout.head_dim}, bf16, 16 tokens), "
          f"{args.batch} blocks a capture / a request; host tier {'pinned' if device.type == 'cuda' else 'unpinned'}")
    print("| path | GB/s | limit GB/s | of the limit |")
    print("| --- | --- | --- | --- |")
    rows = [("disk tier read + decode + verify", gbps(on_disk, read_s), "plain sequential read", gbps(on_disk, plain_s)),
            ("disk tier write (temp + rename)", gbps(on_disk, write_s), "plain write", gbps(on_disk, plain_write_s)),
            ("host tier put", gbps(total, put_s), "bare copy", gbps(total, copy_s)),
            ("host tier get (a copy out)", gbps(total, get_s), "bare copy", gbps(total, copy_s)), *moved]
    for name, ours, limit_name, limit in rows:
        print(f"| {name} | {ours:.2f} | {limit:.2f} ({limit_name}) | {ours / limit:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

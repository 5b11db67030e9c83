"""NIXL read bandwidth: NixlImporter.read_blocks from another process vs a one-process index_select.

    python benchmarks/nixl_dram_bandwidth.py [--blocks 96] [--device cpu|cuda] [--repeats 10]

An exporter process registers a SmolLM2-shaped cache (30 layers, 3 KV heads, head dim 64, block
16, float32, --num-blocks blocks) with NIXL; this process reads --blocks scattered block ids of
every layer and k/v from it, checks the bytes once, and times the reads. The same bytes gathered
by torch.index_select from a cache in this process are the reference. Prints median GB/s of each,
the first read (connection set-up) and a one-block read (per-read overhead); read_blocks_async is
timed with a fresh event loop per read.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.kv.transports.nixl.plane import NixlImporter, nixl_unavailable_reason  # noqa: E402
from benchmarks.nixl_exporter import ExporterProcess, fill_cache  # noqa: E402


def median_seconds(step: Callable[[], None], repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=96)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    reason = nixl_unavailable_reason()
    if reason is not None:
        sys.exit(f"NIXL cannot run here: {reason}")

    dtype = getattr(torch, args.dtype)
    shape = (args.layers, 2, args.num_blocks, args.block_size, args.kv_heads, args.head_dim)
    ids = torch.randperm(args.num_blocks, generator=torch.Generator().manual_seed(1))[:args.blocks]
    exporter = ExporterProcess(shape, {"cache": dtype}, args.device)
    importer = NixlImporter()
    try:
        info = exporter.infos["cache"]
        out = torch.empty(args.layers, 2, args.blocks, *shape[3:], dtype=dtype, device=args.device)
        nbytes = out.numel() * out.element_size()
        started = time.perf_counter()
        importer.read_blocks(info, ids.tolist(), out)
        first_s = time.perf_counter() - started
        local = fill_cache(shape, dtype, args.device)
        index = ids.to(args.device)
        assert torch.equal(out, local[:, :, index]), "NIXL read different bytes from the exporter's cache"
        nixl_s = median_seconds(lambda: importer.read_blocks(info, ids.tolist(), out), args.repeats, args.device)
        async_s = median_seconds(lambda: asyncio.run(importer.read_blocks_async(info, ids.tolist(), out)),
                                 args.repeats, args.device)
        one = out[:, :, :1].clone()
        one_s = median_seconds(lambda: importer.read_blocks(info, ids[:1].tolist(), one), args.repeats, args.device)
        copy_s = median_seconds(lambda: torch.index_select(local, 2, index, out=out), args.repeats, args.device)
    finally:
        importer.close()
        exporter.stop()
    print(f"{args.blocks} blocks of {info.geometry()} ({args.dtype}, {args.device}): {nbytes / 1e6:.1f} MB a read")
    print(f"NIXL read_blocks (another process): {nbytes / nixl_s / 1e9:8.2f} GB/s  median {nixl_s * 1e3:.2f} ms"
          f"  (first read, with connection set-up: {first_s * 1e3:.1f} ms; one block: {one_s * 1e3:.3f} ms)")
    print(f"NIXL read_blocks_async:             {nbytes / async_s / 1e9:8.2f} GB/s  median {async_s * 1e3:.2f} ms")
    print(f"torch.index_select (this process):  {nbytes / copy_s / 1e9:8.2f} GB/s  median {copy_s * 1e3:.2f} ms")


if __name__ == "__main__":
    main()

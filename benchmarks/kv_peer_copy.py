"""A session's KV blocks from one GPU's cache into another's, every way we have: which is fastest over NVLink?

    python -m benchmarks.kv_peer_copy [--tokens 1500] [--shape llama-3.2-3b] [--repeat 20]

Two caches [layers, 2, blocks, block_size, kv_heads, head_dim] (bf16) on cuda:0 (the exporter) and cuda:1 (the
importer), peer access on, and the blocks of a --tokens session copied with:
- `reference`: the torch path (index_select on the source GPU, one peer copy, index_copy on ours),
- `pull`: the Triton block-copy kernel on the importer's GPU reading the exporter's memory (peer reads),
- `push`: the same kernel on the exporter's GPU writing ours (peer writes),
- `copy-engine`: one cudaMemcpy2DAsync per run of consecutive blocks (all layers in one 2-D copy), on the
  importer's stream (the GPUs' DMA engines, no SMs),
each for consecutive block ids (a fresh session's) and shuffled ones. Prints the median GPU time (CUDA events),
the host time of the enqueue, GB/s, and the physical limit: NVLink's one-way rate measured by one large
contiguous peer copy in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.kv.transports.cuda_ipc import peer_copy  # noqa: E402
from common.kv.transports.cuda_ipc.block_copy import copy_blocks_reference  # noqa: E402

SHAPES = {"llama-3.2-3b": (28, 8, 128), "llama-3.2-1b": (16, 8, 64), "llama-3.1-8b": (32, 8, 128)}


def timed(fn, stream: torch.cuda.Stream | None, repeat: int) -> tuple[float, float]:
    """(median GPU ms between events around fn on `stream`, median host µs fn took to enqueue); without a stream,
    the wall time of fn and both GPUs' synchronisation (the reference path runs on both)."""
    gpu, host = [], []
    for i in range(repeat + 3):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        if stream is None:
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            if i >= 3:
                gpu.append((time.perf_counter() - t) * 1e3)
                host.append(gpu[-1] * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t = time.perf_counter()
        fn()
        host_us = (time.perf_counter() - t) * 1e6
        end.record(stream)
        end.synchronize()
        if i >= 3:
            gpu.append(start.elapsed_time(end))
            host.append(host_us)
    return statistics.median(gpu), statistics.median(host)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--shape", default="llama-3.2-3b", choices=sorted(SHAPES))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=4096, help="blocks in each cache")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs two GPUs")
        return 1
    layers, heads, head_dim = SHAPES[args.shape]
    src_dev, dst_dev = torch.device("cuda", 0), torch.device("cuda", 1)
    shape = (layers, 2, args.blocks, args.block_size, heads, head_dim)
    src = torch.randn(shape, dtype=torch.bfloat16, device=src_dev)
    dst = torch.zeros(shape, dtype=torch.bfloat16, device=dst_dev)
    print(f"peer access 1->0: {torch.cuda.can_device_access_peer(1, 0)}, 0->1: {torch.cuda.can_device_access_peer(0, 1)}")
    peer_copy.enable_peer_access(dst_dev, src_dev)
    peer_copy.enable_peer_access(src_dev, dst_dev)
    n = -(-args.tokens // args.block_size)
    block_bytes = src[0, 0, 0].numel() * src.element_size()
    nbytes = n * layers * 2 * block_bytes
    dst_stream = torch.cuda.Stream(device=dst_dev)
    src_stream = torch.cuda.Stream(device=src_dev)

    big = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=src_dev)
    big_dst = torch.empty_like(big, device=dst_dev)

    def contiguous() -> None:
        with torch.cuda.stream(dst_stream):
            big_dst.copy_(big, non_blocking=True)
    ms, _ = timed(contiguous, dst_stream, args.repeat)
    print(f"{args.shape}, {args.tokens} tokens = {n} blocks, {nbytes / 1e6:.1f} MB per session")
    print(f"limit: one contiguous peer copy of the same bytes: {ms:.3f} ms = {nbytes / ms / 1e6:.0f} GB/s")

    g = torch.Generator().manual_seed(0)
    orders = {"consecutive": (list(range(100, 100 + n)), list(range(2000, 2000 + n))),
              "shuffled": (torch.randperm(args.blocks, generator=g)[:n].tolist(),
                           torch.randperm(args.blocks, generator=g)[:n].tolist())}
    pull = peer_copy.PeerBlockCopier(src, dst, on="dst")
    push = peer_copy.PeerBlockCopier(src, dst, on="src")
    engine = peer_copy.PeerBlockCopier(src, dst, on="copy_engine")
    for order, (src_ids, dst_ids) in orders.items():
        want = src[:, :, src_ids].to(dst_dev)
        for name, fn, stream in (
                ("reference", lambda: copy_blocks_reference(src, src_ids, dst, dst_ids), None),
                ("pull (kernel on ours)", lambda: pull(src_ids, dst_ids, dst_stream), dst_stream),
                ("push (kernel on theirs)", lambda: push(src_ids, dst_ids, src_stream), src_stream),
                ("copy-engine (2-D per run)", lambda: engine(src_ids, dst_ids, dst_stream), dst_stream)):
            dst.zero_()
            torch.cuda.synchronize(1)
            try:
                ms, host_us = timed(fn, stream, args.repeat)
            except Exception as exc:  # noqa: BLE001 - a bench reports what failed and goes on
                print(f"  {order:<12} {name:<28} failed: {str(exc).splitlines()[0]}")
                continue
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            ok = torch.equal(dst[:, :, dst_ids], want)
            print(f"  {order:<12} {name:<28} {ms:7.3f} ms  {nbytes / ms / 1e6:6.0f} GB/s  host {host_us:7.1f} us"
                  f"  {'ok' if ok else 'WRONG'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

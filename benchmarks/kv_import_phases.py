"""Where a cuda_ipc import's time goes, in one process on one GPU (no gRPC, no second process):

    python -m benchmarks.kv_import_phases [--blocks 94] [--layers 28] [--kv-heads 8] [--head-dim 128]

- `kernel`: GPU time of cuda_ipc's block_copy kernel alone, for each tile size and warp count tried (the GPU is
  kept busy while the host launches, so host overhead stays out), next to a contiguous copy of the same bytes;
- `copier`: the host time of one BlockCopier call (the ids in pinned memory, the launch), without waiting;
- `import`: cuda_ipc's direct.import_placed end to end (reserve, copy on the side stream, wait, fence check),
  which is what a decode worker's pull adds to it, bar the lookup of the mapping.
The default shape is a 1500-token session of Llama-3.2-3B (bf16, blocks of 16).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.block_manager import BlockManager  # noqa: E402
from common.kv import blocks  # noqa: E402
from common.kv.fence import EPOCH_ATTRIBUTE, BlockEpochs  # noqa: E402
from common.kv.layout import KvLayout  # noqa: E402
from common.kv.transports.cuda_ipc import block_copy, block_copy_triton, direct  # noqa: E402
from common.pb.disagg.v1 import common_pb2  # noqa: E402


def gpu_ms(launch, repeats: int = 30) -> float:
    """Median GPU time of `launch()`: a sleep kernel keeps the GPU busy while the host launches."""
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def kernel_for(src: torch.Tensor, dst: torch.Tensor, tile_words: int, num_warps: int) -> block_copy_triton.CopyKernel:
    words, planes = src[0, 0, 0].numel() * src.element_size() // 4, src.shape[0] * 2
    return block_copy_triton.CopyKernel(src.view(-1).view(torch.int32), dst.view(-1).view(torch.int32), planes,
                                        src.shape[2], dst.shape[2], words, tile_words, num_warps)


def triton_launch(kernel: block_copy_triton.CopyKernel, ids: torch.Tensor, n: int) -> None:
    """The kernel's launch through Triton's own launcher (binding and specialising every argument), as CopyKernel
    launches only its first time, to compile it."""
    grid = (kernel._planes * n, kernel._tiles, 1)
    block_copy_triton._copy_blocks_kernel[grid](*kernel._args, ids, n, *kernel._sizes, TILE=kernel._tile,
                                                num_warps=kernel._num_warps)


def kernel_variants(src: torch.Tensor, dst: torch.Tensor, n: int) -> dict:
    ids = torch.tensor([*range(100, 100 + n), *range(n, 2 * n)], dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream()
    out = {}
    for tile in (1024, 2048, 4096, 8192):
        for warps in (4, 8):
            kernel = kernel_for(src, dst, tile, warps)
            out[f"tile{tile}_w{warps}"] = round(gpu_ms(lambda: kernel(ids, n, stream)), 4)
    flat_src = src.view(-1)[: n * src[:, :, 0].numel()]
    flat_dst = torch.empty_like(flat_src)
    out["contiguous_copy"] = round(gpu_ms(lambda: flat_dst.copy_(flat_src)), 4)
    return out


def host_ms(call, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times[1:]) * 1e3


def import_ms(src: torch.Tensor, n: int, block_size: int, repeats: int = 30) -> float:
    epochs = BlockEpochs.create(src.shape[2])
    local = torch.empty((*src.shape[:2], 2 * n + 2, *src.shape[3:]), dtype=src.dtype, device="cuda")
    blocks = BlockManager(2 * n + 2, block_size).kv_blocks(local)
    ref = common_pb2.KvSessionRef(session_id="s", endpoint="local", num_tokens=n * block_size - 3,
                                  block_size=block_size, block_ids=list(range(100, 100 + n)),
                                  attributes={EPOCH_ATTRIBUTE: "0"})
    layout = KvLayout(src.shape[0], src.shape[4], src.shape[5], block_size, "bfloat16", "x")
    copier = block_copy.BlockCopier(src, local)

    async def one() -> float:
        start = time.perf_counter()
        placed = await direct.import_placed(copier, epochs, ref, layout, blocks, lambda: None)
        took = time.perf_counter() - start
        placed.discard()
        return took

    async def run() -> list[float]:
        return [await one() for _ in range(repeats + 1)]
    try:
        return statistics.median(asyncio.run(run())[1:]) * 1e3
    finally:
        epochs.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=94)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    n = args.blocks
    shape = (args.layers, 2, 2048, args.block_size, args.kv_heads, args.head_dim)
    src = torch.randn(shape, device="cuda").to(torch.bfloat16)
    dst = torch.empty((*shape[:2], 2 * n, *shape[3:]), dtype=torch.bfloat16, device="cuda")
    num_bytes = n * src[:, :, 0].numel() * src.element_size()
    kernels = kernel_variants(src, dst, n)
    src_ids, dst_ids = list(range(100, 100 + n)), list(range(n, 2 * n))
    copier = block_copy.BlockCopier(src, dst)
    ids = torch.tensor([*src_ids, *dst_ids], dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream()
    launch_ms = host_ms(lambda: triton_launch(copier.kernel, ids, n))
    ids_ms = host_ms(lambda: blocks.pinned_ids(src_ids, dst_ids))
    print(json.dumps({"figure": "kv_import_phases", "bytes": num_bytes, "kernel_ms": kernels,
                      "pinned_ids_host_ms": round(ids_ms, 4), "triton_launch_host_ms": round(launch_ms, 4),
                      "compiled_launch_host_ms": round(host_ms(lambda: copier.kernel(ids, n, stream)), 4),
                      "copier_host_ms": round(host_ms(lambda: copier(src_ids, dst_ids)), 4),
                      "import_placed_ms": round(import_ms(src, n, args.block_size), 4)}), flush=True)


if __name__ == "__main__":
    main()

"""Decode attention's KV read bandwidth under launch shapes (DecodeTuning), for the shapes the bench runs.

    python -m benchmarks.gpu.sweep_decode_attention [--budget-s 90] [--shapes 3b-b256-c1400,...]

One JSON line per (shape, tuning): bytes of K and V read / median kernel time, and its fraction of the HBM
copy bandwidth; the best tuning of each shape last. Random bf16 cache, blocks scattered as after churn.
"""
from __future__ import annotations

import json
import time

import torch
from triton.testing import do_bench

from common.engine.attention_triton import DecodeTuning, TritonPagedAttention
from benchmarks.gpu.attention_cases import scattered_layout, sweep_args

SHAPES = {  # name: (batch, context, heads, kv_heads, head_dim)
    "1b-b64-c1000": (64, 1000, 32, 8, 64),
    "1b-b1-c512": (1, 512, 32, 8, 64),
    "3b-b1-c512": (1, 512, 24, 8, 128),
    "1b-b8-c16k": (8, 16384, 32, 8, 64),
    "3b-b64-c1000": (64, 1000, 24, 8, 128),
    "3b-b32-c1400": (32, 1400, 24, 8, 128),  # a 1P1D decode worker at 24-80 req/s: 30-65 rows
    "3b-b64-c1400": (64, 1400, 24, 8, 128),
    "3b-b128-c1400": (128, 1400, 24, 8, 128),  # a decode worker of a 3-prefill, 1-decode split (input 512-2048)
    "3b-b256-c1400": (256, 1400, 24, 8, 128),
}
KERNELS = [(64, 4, 3), (32, 4, 3), (64, 4, 2), (64, 8, 3), (128, 4, 3), (128, 8, 3), (64, 2, 3)]
TARGETS = [(256, 32), (1024, 64), (4096, 64)]


def hbm_bandwidth() -> float:
    src = torch.empty(2**30, dtype=torch.uint16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)


def case(shape: tuple[int, int, int, int, int], block_size: int = 16):
    batch, ctx, heads, kv_heads, dim = shape
    layout = scattered_layout([ctx] * batch, [1] * batch, block_size)
    num_blocks = sum(map(len, layout.block_tables))
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    kv_bytes = 2 * batch * (ctx + 1) * kv_heads * dim * 2
    return layout, cache, q, kv_bytes


def main() -> None:
    args = sweep_args(__doc__, SHAPES, budget_s=90.0)
    start = time.perf_counter()
    bw = hbm_bandwidth()
    print(json.dumps({"hbm_copy_bandwidth": bw}), flush=True)
    best: dict[str, dict] = {}
    for name in args.shapes:
        shape = SHAPES[name]
        layout, cache, q, kv_bytes = case(shape)
        for block_n, warps, stages in KERNELS:
            for target, max_splits in TARGETS:
                if time.perf_counter() - start > args.budget_s:
                    break
                tuning = DecodeTuning(block_n, warps, stages, target, max_splits)
                backend = TritonPagedAttention(16, {None}, torch.device("cuda"), tuning)
                meta = backend.prepare(layout)
                ms = do_bench(lambda: backend.attend(q, cache, meta, shape[4] ** -0.5, None), warmup=5, rep=20,
                              return_mode="median")
                row = {"shape": name, "tuning": [block_n, warps, stages, target, max_splits], "us": ms * 1e3,
                       "fraction_of_hbm": kv_bytes / (ms * 1e-3) / bw}
                print(json.dumps(row), flush=True)
                if name not in best or row["us"] < best[name]["us"]:
                    best[name] = row
        del cache
    print("\n| shape | best tuning (block_n, warps, stages, target, max_splits) | µs | KV read / HBM bw |")
    for name, row in best.items():
        print(f"| {name} | {row['tuning']} | {row['us']:.1f} | {row['fraction_of_hbm']:.1%} |")


if __name__ == "__main__":
    main()

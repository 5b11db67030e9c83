"""Search the batch-1 Triton GEMV's tile configurations on the Llama-3.2-1B / 3B layer shapes, timed the way a
decode step runs them (inside a CUDA graph, back to back over weight copies the L2 cannot hold), next to
cuBLAS with the prologue as its own kernel and next to the weight bytes / HBM bandwidth.

    python -m benchmarks.gpu.sweep_gemv [--budget-s 240]

Prints one JSON line per shape: the best configuration, its µs, cuBLAS's, and `config_for`'s current choice.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from common.engine.kernels import gemv as G
from benchmarks.gpu_engine_vs_hf import hbm_bandwidth

SHAPES = [  # (name, N, K, prologue)
    ("1b.qkv", 3072, 2048, "add_norm"), ("1b.o", 2048, 2048, None), ("1b.gate_up", 16384, 2048, "add_norm"),
    ("1b.down", 2048, 8192, "silu_mul"), ("1b.lm_head", 128256, 2048, None),
    ("3b.qkv", 5120, 3072, "add_norm"), ("3b.o", 3072, 3072, None), ("3b.gate_up", 16384, 3072, "add_norm"),
    ("3b.down", 3072, 8192, "silu_mul"), ("3b.lm_head", 128256, 3072, None),
]


def grid(k: int, stage: int, best: list[G.GemvConfig]) -> list[G.GemvConfig]:
    if stage == 1:
        return [G.GemvConfig(bn, bk, w, 3) for bn, bk, w in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048),
                                                                             (4, 8))
                if k % bk == 0 and bn * bk <= 16384]
    return list({G.GemvConfig(c.block_n, c.block_k, w, s) for c in best for w, s in
                 itertools.product((2, 4, 8), (2, 3, 4))} - set(best))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=240)
    parser.add_argument("--shapes", default="", help="comma-separated names (default: all)")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    bw = hbm_bandwidth()
    print(json.dumps({"hbm_copy_bandwidth": bw}), flush=True)
    wanted = set(filter(None, args.shapes.split(",")))
    for name, n, k, prologue in SHAPES:
        if wanted and name not in wanted:
            continue
        weight = torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
        ideal_us = weight.numel() * 2 / bw * 1e6
        current = G.config_for(n, k)
        ours_now, cublas = G.compare(weight, None, prologue, current)
        timings: dict[G.GemvConfig, float] = {}
        for stage in (1, 2):
            best = sorted(timings, key=timings.get)[:3]
            for config in grid(k, stage, best):
                if time.monotonic() > deadline:
                    break
                try:
                    timings[config] = G.compare(weight, None, prologue, config)[0]
                except Exception as exc:  # a tile that does not compile (registers, shared memory): skip it
                    print(f"  {name} {config}: {type(exc).__name__}", flush=True)
        top = sorted(timings, key=timings.get)[:5]
        print(json.dumps({
            "shape": name, "n": n, "k": k, "prologue": prologue, "ideal_us": round(ideal_us, 2),
            "cublas_us": round(cublas, 2), "current": vars(current), "current_us": round(ours_now, 2),
            "best": [dict(vars(c), us=round(timings[c], 2)) for c in top], "tried": len(timings),
        }), flush=True)
        del weight
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

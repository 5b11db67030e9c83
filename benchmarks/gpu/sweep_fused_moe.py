"""Search the fused MoE kernels' tiles (kernels/fused_moe.MoeTile) on Qwen3-30B-A3B's sparse block, per token count,
timed as fused_moe.applies times a path (inside a CUDA graph, each call routed anew so its experts are not in the
L2), next to the torch path and to the bytes of the experts hit / HBM bandwidth.

    python -m benchmarks.gpu.sweep_fused_moe [--tokens 1 64 512] [--budget-s 240]

Prints one JSON line per token count: the torch path's µs, `tile_for`'s, and the best tiles found.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from common.engine.kernels import fused_moe as F
from common.engine.models import moe
from benchmarks.gpu_engine_vs_hf import hbm_bandwidth

E, H, I, K = 128, 2048, 768, 8  # Qwen3-30B-A3B: experts, hidden, expert intermediate, experts a token


def tiles(tokens: int) -> list[F.MoeTile]:
    ms = (16,) if tokens * K / E <= 16 else (16, 32, 64) if tokens * K / E <= 128 else (32, 64, 128)
    return [F.MoeTile(m, n, k, dn, w, s) for m, n, k, dn, w, s in itertools.product(
        ms, (32, 64, 128), (64, 128, 256), (32, 64, 128), (4, 8), (2, 3, 4))
        if m * k <= 16384 and n * k <= 32768 and not (m >= 64 and w == 4 and n >= 128)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    parser.add_argument("--budget-s", type=float, default=240)
    args = parser.parse_args()
    bw = hbm_bandwidth()
    gate_up = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    per_token = args.budget_s / len(args.tokens)

    def torch_path(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        weights, ids = moe.route(logits, K, True)
        return moe.run_experts(x, gate_up, down, ids, weights)

    def fused_path(tile: F.MoeTile | None):
        def run(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            weights, ids = F.route(logits, K, True)
            return F.fused_experts(x, gate_up, down, ids, weights, tile)
        return run

    for tokens in args.tokens:
        deadline = time.monotonic() + per_token
        x = torch.empty(tokens, H, device="cuda", dtype=torch.bfloat16)
        hit = min(E, tokens * K)  # about: uniform routing
        ideal_us = hit * 3 * I * H * 2 / bw * 1e6
        timings: dict[F.MoeTile, float] = {}
        for tile in sorted(tiles(tokens), key=lambda t: hash(t) % 997):  # a spread of the grid first
            if time.monotonic() > deadline:
                break
            try:
                timings[tile] = F.time_path(fused_path(tile), tokens, x, E)
            except Exception as exc:  # a tile that does not compile (registers, shared memory): skip it
                print(f"  {tokens} {tile}: {type(exc).__name__}", flush=True)
        top = sorted(timings, key=timings.get)[:5]
        print(json.dumps({
            "tokens": tokens, "ideal_us": round(ideal_us, 1),
            "torch_us": round(F.time_path(torch_path, tokens, x, E), 1),
            "current": vars(F.tile_for(tokens * K / E)),
            "current_us": round(F.time_path(fused_path(None), tokens, x, E), 1),
            "best": [dict(vars(t), us=round(timings[t], 1)) for t in top], "tried": len(timings),
        }), flush=True)


if __name__ == "__main__":
    main()

"""Prefill attention's FLOP rate under launch shapes (PrefillTuning), next to torch's SDPA (flash) and the bf16
matmul peak, for the steps a prefill worker and an aggregated worker run.

    python -m benchmarks.gpu.sweep_prefill_attention [--budget-s 120] [--shapes 3b-8192,...]

One JSON line per (shape, tuning): the causal attention's FLOPs (QK^T and PV over the keys each query sees) / median
kernel time; the best tuning of each shape last, with SDPA's rate on the same fresh prompts (dense q, k, v: no
paging, no chunk context) where the shape has no context. Random bf16 cache, blocks scattered as after churn.
"""
from __future__ import annotations

import json
import time

import torch
from triton.testing import do_bench

from common.engine.attention_triton import PrefillTuning, TritonPagedAttention
from benchmarks.gpu_prefill import matmul_peak_flops
from benchmarks.gpu.attention_cases import scattered_layout, sweep_args

HEADS = (24, 8, 128)  # Llama-3.2-3B: query heads, KV heads, head dim
SHAPES = {  # name: (context_lens, query_lens)
    "3b-8192": ([0] * 6, [1366, 1366, 1365, 1365, 1365, 1365]),  # a prefill worker's 8192-token step
    "3b-2048x1": ([0], [2048]),
    "3b-512x4": ([0] * 4, [512] * 4),
    "3b-chunk512-ctx1536": ([1536], [512]),  # an aggregated worker's chunk of a long prompt
}
TUNINGS = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 32, 4, 3),
           (128, 64, 8, 2), (64, 64, 4, 2), (128, 128, 8, 2), (64, 32, 4, 3)]


def attention_flops(ctx: list[int], qlen: list[int], heads: int, dim: int) -> float:
    keys = sum(q * c + q * (q + 1) // 2 for c, q in zip(ctx, qlen))  # (query, key) pairs the causal mask keeps
    return 4 * heads * dim * keys


def case(ctx: list[int], qlen: list[int], block_size: int = 16):
    heads, kv_heads, dim = HEADS
    layout = scattered_layout(ctx, qlen, block_size)
    num_blocks = sum(map(len, layout.block_tables))
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(sum(qlen), heads, dim, device="cuda", dtype=torch.bfloat16)
    return layout, cache, q


def sdpa_flops_per_s(qlen: list[int]) -> float | None:
    """torch SDPA over the same fresh prompts (one call per length group, GQA expanded by SDPA itself)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads, dim = HEADS
    groups: dict[int, int] = {}
    for q in qlen:
        groups[q] = groups.get(q, 0) + 1
    tensors = [(torch.randn(n, heads, q, dim, device="cuda", dtype=torch.bfloat16),
                torch.randn(n, kv_heads, q, dim, device="cuda", dtype=torch.bfloat16),
                torch.randn(n, kv_heads, q, dim, device="cuda", dtype=torch.bfloat16)) for q, n in groups.items()]

    def run():
        for q, k, v in tensors:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms = do_bench(run, warmup=5, rep=30, return_mode="median")
    except RuntimeError as exc:  # no flash kernel for this GPU / build
        print(json.dumps({"sdpa_flash": f"unavailable: {exc}"[:200]}), flush=True)
        return None
    return attention_flops([0] * len(qlen), qlen, heads, dim) / (ms * 1e-3)


def main() -> None:
    args = sweep_args(__doc__, SHAPES, budget_s=120.0)
    start = time.perf_counter()
    peak = matmul_peak_flops()
    print(json.dumps({"bf16_matmul_peak": peak}), flush=True)
    heads, _, dim = HEADS
    best: dict[str, dict] = {}
    for name in args.shapes:
        ctx, qlen = SHAPES[name]
        layout, cache, q = case(ctx, qlen)
        flops = attention_flops(ctx, qlen, heads, dim)
        sdpa = sdpa_flops_per_s(qlen) if not any(ctx) else None
        for block_m, block_n, warps, stages in TUNINGS:
            if time.perf_counter() - start > args.budget_s:
                break
            backend = TritonPagedAttention(16, {None}, torch.device("cuda"),
                                           prefill_tuning=PrefillTuning(block_m, block_n, warps, stages))
            meta = backend.prepare(layout)
            try:
                ms = do_bench(lambda: backend.attend(q, cache, meta, dim**-0.5, None), warmup=5, rep=30,
                              return_mode="median")
            except Exception as exc:  # a launch shape the compiler refuses (shared memory): skip it
                print(json.dumps({"shape": name, "tuning": [block_m, block_n, warps, stages],
                                  "error": f"{type(exc).__name__}: {exc}"[:200]}), flush=True)
                continue
            row = {"shape": name, "tuning": [block_m, block_n, warps, stages], "us": ms * 1e3,
                   "tflops": flops / (ms * 1e-3) / 1e12, "sdpa_tflops": sdpa / 1e12 if sdpa else None}
            print(json.dumps(row), flush=True)
            if name not in best or row["us"] < best[name]["us"]:
                best[name] = row
    print(f"\nbf16 matmul peak {peak / 1e12:.0f} TFLOP/s")
    print("| shape | best tuning (block_m, block_n, warps, stages) | µs | TFLOP/s | SDPA flash TFLOP/s |")
    for name, row in best.items():
        sdpa = f"{row['sdpa_tflops']:.0f}" if row["sdpa_tflops"] else "-"
        print(f"| {name} | {row['tuning']} | {row['us']:.1f} | {row['tflops']:.0f} | {sdpa} |")


if __name__ == "__main__":
    main()

"""Paged-attention cases the GPU kernel tests and sweeps share: block tables scattered as after churn, a kernel's
largest difference from the torch reference on random bf16 inputs, and the sweeps' command line. Importable without a
GPU."""
from __future__ import annotations

import argparse
from itertools import accumulate

import torch

from common.engine.attention import BatchLayout, TorchPagedAttention


def scattered_layout(ctx: list[int], qlen: list[int], block_size: int, num_blocks: int | None = None,
                     gen: torch.Generator | None = None) -> BatchLayout:
    """Each sequence's blocks (its context and its new tokens) taken in turn from one random permutation of a pool of
    `num_blocks` (default: just the blocks they need), drawn from `gen` (default: torch's global generator)."""
    counts = [-(-(c + q) // block_size) for c, q in zip(ctx, qlen)]
    perm = torch.randperm(num_blocks or sum(counts), generator=gen).tolist()
    tables = [perm[start:start + n] for start, n in zip(accumulate(counts, initial=0), counts)]
    return BatchLayout(query_lens=list(qlen), context_lens=list(ctx), block_tables=tables)


def max_error_against_reference(backend, ctx: list[int], qlen: list[int], window: int | None, seed: int,
                                heads: tuple[int, int, int] = (24, 8, 128), block_size: int = 16,
                                num_blocks: int = 1024) -> float:
    """`backend.forward` (stores the new K/V, attends) against TorchPagedAttention in float32 on the same bf16 inputs
    and cache (Llama-3.2-3B's heads by default): the largest absolute difference."""
    num_heads, num_kv_heads, dim = heads
    device = backend.device
    gen = torch.Generator().manual_seed(seed)
    layout = scattered_layout(ctx, qlen, block_size, num_blocks, gen)
    tokens = sum(qlen)
    q = torch.randn(tokens, num_heads, dim, generator=gen).bfloat16()
    k = torch.randn(tokens, num_kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(tokens, num_kv_heads, dim, generator=gen).bfloat16()
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, dim, generator=gen).bfloat16().to(device)
    ref = TorchPagedAttention(block_size, {window}, device)
    expected = ref.forward(q.float().to(device), k.float().to(device), v.float().to(device), cache.float(),
                           ref.prepare(layout), dim**-0.5, window)
    got = backend.forward(q.to(device), k.to(device), v.to(device), cache, backend.prepare(layout), dim**-0.5, window)
    return (got.float() - expected).abs().max().item()


def sweep_args(doc: str, shapes: dict, budget_s: float) -> argparse.Namespace:
    """A sweep's command line: --budget-s, and --shapes as a list of names of `shapes`. An unknown name, or no CUDA
    GPU to time kernels on, ends it with one line (exit 2)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=budget_s, help="stop starting new tunings after this long")
    parser.add_argument("--shapes", type=lambda text: text.split(","), default=list(shapes),
                        help="comma-separated names of " + ", ".join(shapes))
    args = parser.parse_args()
    unknown = [name for name in args.shapes if name not in shapes]
    if unknown:
        parser.error(f"--shapes: no shape {', '.join(unknown)}; the shapes are {', '.join(shapes)}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: a sweep times the kernels on one")
    return args

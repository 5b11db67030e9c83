"""The Triton kernel of block_copy.py (CUDA only; importing this module needs triton)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_WORDS, WARPS = 2048, 4  # 8 KiB per program (benchmarks/kv_import_phases.py tries others)

# `n` and the ids' address change with every pull, and the caches' block counts with every pair of caches: left
# unspecialised, one compiled kernel serves every pull into caches of one block shape (CopyKernel launches it
# directly; compile_for compiles it at startup). `words` stays specialised: its divisibility aligns every block.
@triton.jit(do_not_specialize=["n", "src_blocks", "dst_blocks"], do_not_specialize_on_alignment=["ids_ptr"])
def _copy_blocks_kernel(src_ptr, dst_ptr, ids_ptr, n, src_blocks, dst_blocks, words,
                        TILE: tl.constexpr):
    """Program (row, tile): row = plane * n + i moves tile `tile` of block ids[i] of plane `plane` (a layer's K or
    V) to block ids[n + i] of the same plane; one block of one plane is `words` contiguous int32 words."""
    row = tl.program_id(0)
    plane = (row // n).to(tl.int64)
    i = row % n
    src_block = tl.load(ids_ptr + i).to(tl.int64)
    dst_block = tl.load(ids_ptr + n + i).to(tl.int64)
    offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = offs < words
    src = src_ptr + (plane * src_blocks + src_block) * words
    dst = dst_ptr + (plane * dst_blocks + dst_block) * words
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


class CopyKernel:
    """The kernel for one pair of caches (int32 views of them), compiled by its first launch and launched straight
    from the compiled kernel after that: Triton's own launch binds and specialises every argument again, which costs
    more host time than the rest of a pull's launch work together."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, planes: int, src_blocks: int, dst_blocks: int,
                 words: int, tile_words: int = TILE_WORDS, num_warps: int = WARPS):
        self._args = (src, dst)
        self._sizes = (src_blocks, dst_blocks, words)
        self._planes, self._num_warps = planes, num_warps
        self._tile = min(tile_words, triton.next_power_of_2(words))
        self._tiles = triton.cdiv(words, self._tile)
        self._compiled = None

    def __call__(self, ids: torch.Tensor, n: int, stream: torch.cuda.Stream) -> None:
        """Enqueue the copy of blocks ids[:n] to ids[n:2n] on `stream`, a stream of the caches' GPU."""
        grid = (self._planes * n, self._tiles, 1)
        if self._compiled is None:  # Triton compiles it for the current device and stream
            with torch.cuda.stream(stream):
                self._compiled = _copy_blocks_kernel[grid](*self._args, ids, n, *self._sizes, TILE=self._tile,
                                                           num_warps=self._num_warps)
            return
        with torch.cuda.device(stream.device):  # a launch goes to the current device's context
            self._compiled[grid](*self._args, ids, n, *self._sizes, self._tile, stream=stream.cuda_stream)

"""The Triton kernel of common.kv.block_copy (CUDA only; importing this module needs triton)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
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


def launch(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, n: int, planes: int, src_blocks: int,
           dst_blocks: int, words: int, tile_words: int, num_warps: int) -> None:
    tile = min(tile_words, triton.next_power_of_2(words))
    grid = (planes * n, triton.cdiv(words, tile))
    _copy_blocks_kernel[grid](src, dst, ids, n, src_blocks, dst_blocks, words, TILE=tile, num_warps=num_warps)

"""Chained block hashes: one function for the engine's prefix cache, its KV events and the router's KV index.

A full block's hash is xxh3_64(parent_hash ‖ token_ids as int64 ‖ extra); the first block's parent is ROOT_HASH.
Torch-free, so the router computes the same hashes without loading an engine.
"""
from __future__ import annotations

import numpy as np
import xxhash

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: list[int], extra: bytes = b"") -> int:
    """Chained hash of one full block; `extra` keys content the ids don't show (e.g. an image's hash)."""
    h = xxhash.xxh3_64()
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra)
    return h.intdigest()


def hash_blocks(token_ids: list[int], block_size: int, parent_hash: int = ROOT_HASH) -> list[int]:
    """Hashes of every full block of `token_ids`."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes

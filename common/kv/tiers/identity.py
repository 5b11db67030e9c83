"""What a stored KV block was computed by: the layout fingerprint every tier keys its records under.

Two engines may share a stored block only if they would have computed the same bytes for it: the same model config,
dtype and KV format (the engine's fingerprint, common.kv.layout.model_fingerprint), the same weights (two fine-tunes
of one architecture share a fingerprint), block size, shape and shard of heads. `TierLayout.id` names a disk tier's
directory; every record carries the whole layout, checked field by field on the way up.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import xxhash

from common.kv.layout import KvLayout

# How much of each weights file the identity reads, from each end: a fine-tune differs from its base in the first
# tensors already; the whole file would take a multi-GB read at every start.
_SAMPLE_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass(frozen=True)
class TierLayout:
    fingerprint: str
    """The engine's model fingerprint: config, dtype, KV format."""
    weights: str
    """weights_identity of the model directory."""
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    shard: str = "all-heads"
    """Which KV heads a block holds: our caches hold every head, whatever the tensor-parallel size."""

    @classmethod
    def of(cls, layout: KvLayout, weights: str) -> "TierLayout":
        return cls(fingerprint=layout.fingerprint, weights=weights, block_size=layout.block_size, dtype=layout.dtype,
                   num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim)

    def as_dict(self) -> dict:
        return asdict(self)

    @cached_property
    def id(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:20]

    def differences(self, other: dict) -> list[str]:
        """Each field of `other` (a record's layout) that differs from ours, as 'name: stored=… ours=…'."""
        mine = self.as_dict()
        names = sorted(set(mine) | set(other))
        return [f"{n}: stored={other.get(n)!r} ours={mine.get(n)!r}" for n in names if other.get(n) != mine.get(n)]


def weights_identity(model_dir: str, load_format: str = "auto", dummy_seed: int = 0) -> str:
    """A short hash of the weights a model directory holds: each weights file's name, size and the bytes at both
    of its ends (dummy weights: their seed)."""
    if load_format == "dummy":
        return f"dummy-{dummy_seed}"
    h = xxhash.xxh3_64()
    root = Path(model_dir)
    files = sorted(p for p in root.iterdir() if p.suffix in _WEIGHT_SUFFIXES) if root.is_dir() else []
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            h.update(f.read(_SAMPLE_BYTES))
            if size > 2 * _SAMPLE_BYTES:
                f.seek(size - _SAMPLE_BYTES)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()

"""The layout of exported KV blocks and the fingerprint that says two engines can share them."""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field, fields
from typing import Callable

import torch
from transformers import PretrainedConfig

from common.errors import LayoutMismatch
from common.pb.disagg.v1 import common_pb2

# Bump when the meaning of exported blocks changes (cache layout, RoPE placement, ...).
KV_FORMAT_VERSION = 1
# Config entries that name where a model came from, not what it computes.
_NON_ARCHITECTURAL = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"}


def model_fingerprint(config: PretrainedConfig, dtype: str, extra: dict[str, object] | None = None) -> str:
    """Hash of the model config + dtype + KV format version, and `extra`: what else decides the blocks' values (an
    FP8 cache's dtype and scale, weights quantised at load; an FP8 checkpoint says so in its config). Equal only when
    KV blocks are interchangeable; without `extra` it is what it was before FP8."""
    arch = {k: v for k, v in sorted(config.to_dict().items()) if k not in _NON_ARCHITECTURAL}
    fields = {"config": arch, "dtype": dtype, "kv_format": KV_FORMAT_VERSION, **(extra or {})}
    payload = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    fingerprint: str

    def check_compatible(self, exported: "KvLayout") -> None:
        """Raise LayoutMismatch naming both sides of every difference; never import mismatched KV."""
        diffs = [
            f"{f.name}: exporter={getattr(exported, f.name)!r} importer={getattr(self, f.name)!r}"
            for f in fields(self)
            if getattr(exported, f.name) != getattr(self, f.name)
        ]
        if diffs:
            raise LayoutMismatch("KV layout mismatch (" + "; ".join(diffs) + ")")

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def block_bytes(self) -> int:
        itemsize = getattr(torch, self.dtype).itemsize
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize


def layout_of(ref: common_pb2.KvSessionRef) -> KvLayout:
    """The layout a session ref describes (the exporter's)."""
    return KvLayout(num_layers=ref.num_layers, num_kv_heads=ref.num_kv_heads, head_dim=ref.head_dim,
                    block_size=ref.block_size, dtype=ref.dtype, fingerprint=ref.fingerprint)


@dataclass
class KvExport:
    """A prompt's KV as whole blocks: `blocks` is [layers, 2, n_blocks, block_size, kv_heads, head_dim]."""

    layout: KvLayout
    num_tokens: int
    blocks: torch.Tensor

    def validate(self) -> None:
        expected = self.layout.block_shape(-(-self.num_tokens // self.layout.block_size))
        if tuple(self.blocks.shape) != expected:
            raise LayoutMismatch(f"KV tensor shape {tuple(self.blocks.shape)} does not match its layout {expected}")
        if str(self.blocks.dtype).removeprefix("torch.") != self.layout.dtype:
            raise LayoutMismatch(f"KV tensor dtype {self.blocks.dtype} does not match its layout dtype {self.layout.dtype}")


@dataclass
class PlacedKv:
    """A prompt's KV already in the importing engine's own blocks (copied there by the data plane, into blocks
    it reserved from the engine's pool): the engine adopts `block_ids` instead of copying. Until adopted the
    blocks are the importer's: `discard` gives them back (a no-op once the engine has them)."""

    layout: KvLayout
    num_tokens: int
    block_ids: list[int]
    free: Callable[[list[int]], None]
    _owned: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def validate(self) -> None:
        needed = -(-self.num_tokens // self.layout.block_size)
        if len(self.block_ids) < needed:
            raise LayoutMismatch(f"{len(self.block_ids)} placed blocks cannot hold the KV of {self.num_tokens} tokens")

    def adopt(self) -> list[int] | None:
        """The blocks, handed over once (None if they were discarded or adopted already)."""
        with self._lock:
            owned, self._owned = self._owned, False
        return list(self.block_ids) if owned else None

    def discard(self) -> None:
        block_ids = self.adopt()
        if block_ids is not None:
            self.free(block_ids)

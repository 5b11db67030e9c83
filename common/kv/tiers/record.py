"""One stored KV block: its key (its link of the hash chain), its bytes and their checksum; a record's file format.

A record is `MAGIC ‖ version u16 ‖ 0 u16 ‖ header length u32 ‖ xxh3_64(header) u64 ‖ header JSON ‖ payload`. The
header holds the layout the block was computed under (identity.TierLayout), the block's chained hash, its parent's
hash and its token ids, and the payload's length and xxh3_64. Every check of `decode` and `StoredBlock.verify` that
fails raises RecordRejected with the reason the metrics count: the block is then recomputed, never decoded.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch
import xxhash

from common.kv.block_hash import hash_block
from common.kv.tiers.identity import TierLayout

MAGIC = b"DKVT"
VERSION = 1
_PREFIX = struct.Struct("<4sHHIQ")
_MAX_HEADER = 1 << 20


class RecordRejected(Exception):
    """A stored block that failed a check; `reason` is a short label (truncated, checksum, layout, key, ...)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class BlockKey:
    """A full block's place in a hash chain: its hash = hash_block(parent, tokens)."""

    hash: int
    parent: int
    tokens: tuple[int, ...]

    def consistent(self) -> bool:
        return hash_block(self.parent, list(self.tokens)) == self.hash


def checksum(payload: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(payload.numpy()))


@dataclass
class StoredBlock:
    """A block's KV out of the device: `payload` is its [layers, 2, block_size, kv_heads, head_dim] cache entries as
    bytes (1-D uint8, on the CPU), `tier` where it was read from (or is going)."""

    key: BlockKey
    payload: torch.Tensor
    checksum: int
    tier: str = ""
    load_s: float = 0.0  # seconds reading and verifying it took (on whichever thread read it)
    wait_s: float = 0.0  # its request's share of the wait at admission and of the engine thread's fetch

    def verify(self, expected: BlockKey, block_bytes: int) -> None:
        """Raise RecordRejected unless this is `expected`'s block, whole and intact."""
        if self.key != expected:
            raise RecordRejected("key", f"stored {self.key.hash:016x} (parent {self.key.parent:016x}), wanted "
                                        f"{expected.hash:016x} (parent {expected.parent:016x})")
        if not self.key.consistent():
            raise RecordRejected("key", f"{self.key.hash:016x} is not the hash of its parent and tokens")
        if self.payload.numel() != block_bytes:
            raise RecordRejected("truncated", f"{self.payload.numel()} payload bytes, a block has {block_bytes}")
        if checksum(self.payload) != self.checksum:
            raise RecordRejected("checksum", f"payload of {self.key.hash:016x}")


def encode_header(layout: TierLayout, block: StoredBlock) -> bytes:
    """What precedes the payload in a record file."""
    header = json.dumps({"layout": layout.as_dict(), "hash": block.key.hash, "parent": block.key.parent,
                         "tokens": list(block.key.tokens), "payload_bytes": block.payload.numel(),
                         "payload_xxh3": block.checksum}, sort_keys=True).encode()
    return _PREFIX.pack(MAGIC, VERSION, 0, len(header), xxhash.xxh3_64_intdigest(header)) + header


def decode(data: bytearray, layout: TierLayout, tier: str = "disk") -> StoredBlock:
    """The block of a record's bytes, its header checked (format, checksum, layout) and its payload of the length
    it says; the key and payload checksum are checked by StoredBlock.verify."""
    header, end = _header(data, layout)
    size = header["payload_bytes"]
    if len(data) - end != size:
        raise RecordRejected("truncated", f"{len(data) - end} payload bytes, the header says {size}")
    payload = (torch.frombuffer(data, dtype=torch.uint8, offset=end, count=size) if size
               else torch.empty(0, dtype=torch.uint8))
    key = BlockKey(header["hash"], header["parent"], tuple(header["tokens"]))
    return StoredBlock(key, payload, header["payload_xxh3"], tier)


def read_key(path: str, layout: TierLayout) -> BlockKey:
    """The key a record file says it holds, from its header alone (checked as `decode` checks it): what a tier
    announces of its records before any is read."""
    with open(path, "rb") as f:
        data = f.read(_PREFIX.size)
        if len(data) == _PREFIX.size:
            data += f.read(min(_PREFIX.unpack_from(data)[3], _MAX_HEADER))
    header, _ = _header(data, layout)
    return BlockKey(header["hash"], header["parent"], tuple(header["tokens"]))


def _header(data: bytes | bytearray, layout: TierLayout) -> tuple[dict, int]:
    """A record's header, checked (format, checksum, layout), and where its payload starts."""
    if len(data) < _PREFIX.size:
        raise RecordRejected("truncated", f"{len(data)} bytes")
    magic, version, _, header_len, header_xxh = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise RecordRejected("format", f"magic {magic!r}")
    if version != VERSION:
        raise RecordRejected("format", f"version {version}, ours {VERSION}")
    end = _PREFIX.size + header_len
    if header_len > _MAX_HEADER or len(data) < end:
        raise RecordRejected("truncated", f"header of {header_len} bytes in {len(data)}")
    header_bytes = bytes(data[_PREFIX.size:end])
    if xxhash.xxh3_64_intdigest(header_bytes) != header_xxh:
        raise RecordRejected("checksum", "header")
    header = json.loads(header_bytes)
    diffs = layout.differences(header["layout"])
    if diffs:
        raise RecordRejected("layout", "; ".join(diffs))
    return header, end

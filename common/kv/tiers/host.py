"""The host tier: blocks in host memory (pinned on CUDA, so they move at the copy engines' rate), LRU by access.

One slab of `capacity // block_bytes` rows, allocated once: pinning memory block by block would cost the engine a
driver call per store, and the slab's size is the tier's footprint (on CUDA, with the pinned copies `get` hands out,
which torch's pinned-memory cache keeps for reuse at their peak: the blocks staged for admission at once). Blocks
evicted from the device are copied straight into free slots (`reserve`, then `commit` once checksummed: a reserved
slot is no one else's and no lookup sees it before), with `put` for when no slot is free. Used from the engine thread
(lookups, reservations) and the tiers' mover thread (stores, commits, reads), under one lock.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from common.kv.tiers.record import BlockKey, StoredBlock


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int, block_bytes: int, pin: bool):
        self.block_bytes = block_bytes
        self.num_slots = capacity_bytes // block_bytes
        self.slab = torch.empty((self.num_slots, block_bytes), dtype=torch.uint8, pin_memory=pin)
        self._entries: OrderedDict[int, tuple[int, BlockKey, int]] = OrderedDict()  # hash -> (slot, key, checksum)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._lock = threading.Lock()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self.block_bytes

    def put(self, block: StoredBlock) -> list[StoredBlock]:
        """Store `block` (a no-op but for its LRU place if held); returns the blocks evicted for room, each with a
        copy of its payload, for the tier below."""
        evicted = []
        with self._lock:
            if block.key.hash in self._entries:
                self._entries.move_to_end(block.key.hash)
                return evicted
            if not self.num_slots:
                return [block]
            if not self._free:
                old_hash, (slot, key, sums) = self._entries.popitem(last=False)
                evicted.append(StoredBlock(key, self.slab[slot].clone(), sums, self.name))
                self._free.append(slot)
            slot = self._free.pop()
            self.slab[slot].copy_(block.payload)
            self._entries[block.key.hash] = (slot, block.key, block.checksum)
        return evicted

    def reserve(self, n: int, drop_lru: bool) -> tuple[list[int], list[int]]:
        """Up to `n` slots for blocks copied straight in, each to `commit` or `release`; with `drop_lru` (no tier
        below to hand victims to) the least recently used blocks make room, else only free slots are taken. Returns
        the slots and the hashes dropped for them."""
        dropped = []
        with self._lock:
            while drop_lru and len(self._free) < n and self._entries:
                old_hash, (slot, _, _) = self._entries.popitem(last=False)
                self._free.append(slot)
                dropped.append(old_hash)
            slots = self._free[max(0, len(self._free) - n):]
            del self._free[len(self._free) - len(slots):]
        return slots, dropped

    def commit(self, slot: int, key: BlockKey, checksum: int) -> bool:
        """A reserved slot holds `key`'s block, checksummed: held from now (False, the slot freed: held already)."""
        with self._lock:
            if key.hash in self._entries:
                self._entries.move_to_end(key.hash)
                self._free.append(slot)
                return False
            self._entries[key.hash] = (slot, key, checksum)
            return True

    def release(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def evict_to(self, free_slots: int) -> list[StoredBlock]:
        """Evict the least recently used blocks until `free_slots` slots are free (room for the next evictions
        from the device to be copied straight in); the blocks evicted, each with a copy of its payload."""
        evicted = []
        with self._lock:
            while len(self._free) < free_slots and self._entries:
                _, (slot, key, sums) = self._entries.popitem(last=False)
                evicted.append(StoredBlock(key, self.slab[slot].clone(), sums, self.name))
                self._free.append(slot)
        return evicted

    def get(self, block_hash: int) -> StoredBlock | None:
        """A copy of a held block (made its most recent), or None."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None:
                return None
            self._entries.move_to_end(block_hash)
            slot, key, sums = entry
            return StoredBlock(key, self._copy(slot), sums, self.name)

    def _copy(self, slot: int) -> torch.Tensor:
        """A slot's bytes in memory of their own (a later put may reuse the slot): pinned where the slab is, so the
        copy up to the GPU is a DMA from it, with no copy on the engine thread and no page faults (torch caches the
        pinned buffers freed)."""
        if not self.slab.is_pinned():
            return self.slab[slot].clone()
        payload = torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=True)
        return payload.copy_(self.slab[slot])

    def discard(self, block_hash: int) -> None:
        with self._lock:
            entry = self._entries.pop(block_hash, None)
            if entry is not None:
                self._free.append(entry[0])

"""What the tiers' store thread does with the blocks the engine copied out of its device pool: into the host tier
(a reserved slot checksummed and committed, or a buffered block put), its LRU victims down to disk, or straight to
disk (no host tier, or a write-through); each block announced as it enters a tier, each victim as it leaves.
"""
from __future__ import annotations

import errno
import logging
import time
from typing import Callable

import torch

from common.kv.tiers.disk import DiskFull, DiskTier
from common.kv.tiers.host import HostTier
from common.kv.tiers.metrics import TierMetrics
from common.kv.tiers.record import BlockKey, StoredBlock, checksum

log = logging.getLogger(__name__)


class Stores:
    def __init__(self, host: HostTier | None, disk: DiskTier | None, metrics: TierMetrics, block_bytes: int,
                 headroom: int, stored: Callable[[str, list[BlockKey]], None],
                 removed: Callable[[str, list[int]], None]):
        self.host, self.disk, self.metrics, self.block_bytes = host, disk, metrics, block_bytes
        self.headroom = headroom  # free host slots kept for evictions to be copied straight in
        self._stored, self._removed = stored, removed

    def commit_host(self, keys: list[BlockKey], slots: list[int], ready) -> None:
        """The reserved slots, once their copy has finished, checksummed and held; then room made
        for the next ones, the blocks evicted for it going down to disk."""
        started, host = time.perf_counter(), self.host
        if ready is not None:
            ready.synchronize()
        held = [key for key, slot in zip(keys, slots) if host.commit(slot, key, checksum(host.slab[slot]))]
        self.metrics.offloaded(host.name, len(keys), len(keys) * self.block_bytes, time.perf_counter() - started)
        self._stored(host.name, held)
        if self.disk is not None:
            self._down_from_host(host.evict_to(self.headroom))
        self.metrics.used(host.name, host.used_bytes)

    def _down_from_host(self, down: list[StoredBlock]) -> None:
        if down:
            self.metrics.evicted(self.host.name, len(down))
            self._removed(self.host.name, [b.key.hash for b in down if b.key.hash not in self.host])
            self.write_disk(down)

    @staticmethod
    def stored_blocks(keys: list[BlockKey], rows: torch.Tensor, ready) -> list[StoredBlock]:
        """The copied-out rows (once their copy has finished) as blocks, checksummed."""
        if ready is not None:
            ready.synchronize()
        return [StoredBlock(key, row, checksum(row)) for key, row in zip(keys, rows)]

    def store(self, blocks: list[StoredBlock]) -> None:
        if self.host is None:
            self.write_disk(blocks)
            return
        started, down = time.perf_counter(), []
        for block in blocks:
            down += self.host.put(block)
        self.metrics.offloaded(self.host.name, len(blocks), len(blocks) * self.block_bytes,
                               time.perf_counter() - started)
        self.metrics.used(self.host.name, self.host.used_bytes)
        self._stored(self.host.name, [b.key for b in blocks if b.key.hash in self.host])
        self._down_from_host(down)

    def write_disk(self, blocks: list[StoredBlock]) -> None:
        if self.disk is None:
            return
        started, written, nbytes, there = time.perf_counter(), 0, 0, []
        for block in blocks:
            try:
                size = self.disk.write(block)
                there.append(block)
            except DiskFull:
                self.metrics.store_failed(self.disk.name, "full")
                continue
            except OSError as exc:
                reason = "full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "error"
                self.metrics.store_failed(self.disk.name, reason)
                log.warning("KV disk tier: could not store a block: %s", exc)
                continue
            written += size > 0
            nbytes += size
        if written:
            self.metrics.offloaded(self.disk.name, written, nbytes, time.perf_counter() - started)
        self._stored(self.disk.name, [b.key for b in there])

"""KvTiers: the tiers below one engine's device pool, as its block manager sees them.

Down: the block manager remembers each full block's key when it enters the prefix cache (`remember`); when a cached
free block is reused, `capture` copies its KV out before anything can overwrite it (on a GPU, a copy enqueued on the
engine's stream ahead of the step that reuses the block), straight into free slots of the host tier's slab where
it has them, else into a buffer, and the mover's store thread checksums and stores it (stores.py): into the host
tier, whose LRU victims go on to the disk tier (write-back), or straight to disk where there is no host tier (the
CPU, whose host tier is the device pool itself).
Up: a new request's blocks past its device prefix hit are loaded and verified by the mover's load thread as it is
queued (`prefetch`, overlapped with the steps before its admission; staging.py); at admission the block manager
takes what was staged (`fetch`: loading the rest itself) and `install` copies it into fresh device blocks, which
then count as cached.
Write-through (`write_through`, the node-wide tier): a finished request's full blocks are copied out and stored in
the disk tier at once, while the device keeps them too, so that another worker of the node finds them for the next
turn (a decode worker's answer, for the prefill worker that prefills the next prompt); each block once per content.
Keys are the prefix cache's chained block hashes in every tier. A block that fails a check is recomputed, counted.
A hit is taken only where it pays (`payoff`, payoff.py): blocks of a tier whose onboarding, as requests saw it, costs
more than computing them are recomputed, and admission holds a request for its prefetch no longer than computing
its blocks would take; past that it recomputes them.
With `events` (the engine's KvEventLog) each tier's arrivals and departures are KV events naming the tier, so the
router knows what this worker can onboard (what other processes evict from a shared directory it learns only as
misses).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from common.kv.events import KvEventLog
from common.kv.tiers.disk import DiskTier
from common.kv.tiers.host import HostTier
from common.kv.tiers.identity import TierLayout
from common.kv.tiers.metrics import TierMetrics
from common.kv.tiers.mover import Mover
from common.kv.tiers.payoff import OnboardPayoff
from common.kv.tiers.record import BlockKey, RecordRejected, StoredBlock, decode
from common.kv.tiers.staging import Prefetches
from common.kv.tiers.stores import Stores

log = logging.getLogger(__name__)


class KvTiers:
    # A request whose prefetch still runs waits in the queue (others pass it) for as long as computing its blocks
    # would take (OnboardPayoff.wait_bound_s), at most this long, which also stands until a prefill was measured;
    # then it is admitted anyway and computes them.
    FETCH_WAIT_S = 10.0

    def __init__(self, cache: torch.Tensor, layout: TierLayout, host: HostTier | None, disk: DiskTier | None,
                 metrics: TierMetrics, max_prefetch_blocks: int, mover: Mover | None = None,
                 write_through: bool = False):
        self.layout = layout
        self.device = cache.device
        self.cache_bytes = cache.view(torch.uint8)  # [layers, 2, blocks, block_size, kv_heads, head_dim · itemsize]
        self.block_bytes = self.cache_bytes[:, :, 0].numel()
        self.host, self.disk, self.metrics = host, disk, metrics
        self.max_prefetch_blocks = max_prefetch_blocks
        self.mover = mover or Mover()
        self._pinned = self.device.type == "cuda"
        self._keys: dict[int, BlockKey] = {}  # device block id -> the key of the cached block it holds
        self.write_through = write_through and disk is not None
        self._written: set[int] = set()  # device block ids whose content write-through stored (or a tier gave)
        self.payoff = OnboardPayoff(layout.block_size)
        self.prefetches = Prefetches(self.payoff)  # those waiting for their requests' admission
        self.on_loaded: Callable[[], None] | None = None  # called (on the mover) as a prefetch ends: wakes the engine
        self.events: KvEventLog | None = None  # told what enters and leaves each tier (the engine's, for routing)
        if self.disk is not None:
            self.disk.on_evicted = lambda hashes: self._announce_removed(self.disk.name, hashes)
        # Free host slots kept for evictions to be copied straight in (the store thread evicts to disk ahead).
        headroom = min(host.num_slots // 8, self.mover.max_pending_bytes // self.block_bytes) if host else 0
        self.stores = Stores(host, disk, metrics, self.block_bytes, headroom, self._announce_stored,
                             self._announce_removed)

    @property
    def names(self) -> list[str]:
        return [t.name for t in (self.host, self.disk) if t is not None]

    # --- down (engine thread, then the mover) ---

    def remember(self, block_id: int, key: BlockKey) -> None:
        self._keys[block_id] = key
        self._written.discard(block_id)

    def store_finished(self, blocks: list[tuple[int, int]]) -> None:
        """Write-through: copy out a finished request's cached full blocks (block id, hash) not stored yet, for the
        mover to write to the disk tier; the device keeps them (they stay cached). Engine thread."""
        if not self.write_through:
            return
        keys, ids = [], []
        for block_id, block_hash in blocks:
            key = self._keys.get(block_id)
            if key is not None and key.hash == block_hash and block_id not in self._written:
                keys.append(key)
                ids.append(block_id)
        if ids and self._queue_store(keys, ids, False, self.disk.name, self.stores.write_disk):
            self._written.update(ids)

    def capture(self, evicted: list[tuple[int, int]], sync: bool = False) -> None:
        """Copy out the cached blocks (block id, hash) about to be reused, for the mover to store. Called before
        anything writes them; `sync`: the copy has finished on return (a caller not on the engine's stream)."""
        keys, ids = [], []
        for block_id, block_hash in evicted:
            key = self._keys.pop(block_id, None)
            self._written.discard(block_id)  # (a block written through is touched below: its file's LRU clock)
            if key is not None and key.hash == block_hash and not (self.host is not None and block_hash in self.host):
                keys.append(key)
                ids.append(block_id)
        if not ids:
            return
        self.metrics.evicted("device", len(ids))
        taken = self._into_host(keys, ids, sync) if self.host is not None else 0
        if taken < len(ids):
            self._queue_store(keys[taken:], ids[taken:], sync, self.names[0], self.stores.store)

    def _into_host(self, keys: list[BlockKey], ids: list[int], sync: bool) -> int:
        """Copy the first of device blocks `ids` straight into reserved slots of the host tier's slab, no buffer
        between (on a GPU a DMA a block on the engine's stream), for the mover to checksum and commit; how many."""
        if not self.mover.has_room(len(ids) * self.block_bytes):
            return 0
        slots, dropped = self.host.reserve(len(ids), drop_lru=self.disk is None)
        if dropped:
            self.metrics.evicted(self.host.name, len(dropped))
            self._announce_removed(self.host.name, dropped)
        if not slots:
            return 0
        n, slab = len(slots), self.host.slab
        if self.device.type == "cuda":
            rows = torch.stack([self.cache_bytes[:, :, b] for b in ids[:n]]).view(n, -1)
            for slot, row in zip(slots, rows):
                slab[slot].copy_(row, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            if sync:
                ready.synchronize()
        else:
            shape, ready = self.cache_bytes[:, :, 0].shape, None
            for slot, b in zip(slots, ids):
                slab[slot].view(shape).copy_(self.cache_bytes[:, :, b])
        if self.mover.store(lambda: self.stores.commit_host(keys[:n], slots, ready), n * self.block_bytes):
            return n
        if ready is not None:
            ready.synchronize()  # (a slot freed while its copy is in flight could be written under it)
        self.host.release(slots)
        return 0

    def _queue_store(self, keys: list[BlockKey], ids: list[int], sync: bool, tier: str,
                     store: Callable[[list[StoredBlock]], None]) -> bool:
        """Copy device blocks `ids` out and queue `store` of them (under `keys`) on the mover; False, counted as
        `tier`'s failed stores, when the mover's queue has no room for them."""
        nbytes = len(ids) * self.block_bytes
        if self.mover.has_room(nbytes):
            rows, ready = self._copy_out(ids, sync)
            if self.mover.store(lambda: store(self.stores.stored_blocks(keys, rows, ready)), nbytes):
                return True
        self.metrics.store_failed(tier, "queue_full", len(ids))
        return False

    def _copy_out(self, ids: list[int], sync: bool) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        rows = torch.stack([self.cache_bytes[:, :, b] for b in ids]).view(len(ids), -1)
        if self.device.type != "cuda":
            return rows, None
        host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        if sync:
            ready.synchronize()
            return host, None
        return host, ready

    def announce_held(self) -> None:
        """Tell the events what the disk tier holds already (a restarted worker, the node's other workers' blocks),
        read off the engine thread: the router can then send a prompt here before any of its blocks is touched."""
        if self.disk is not None and self.events is not None:
            disk, events = self.disk, self.events
            self.mover.load(lambda: [events.stored([key.hash], key.parent, tier=disk.name)
                                     for key in disk.held_keys()])

    def _announce_stored(self, tier: str, keys: list[BlockKey]) -> None:
        if self.events is not None:
            for key in keys:
                self.events.stored([key.hash], key.parent, tier=tier)

    def _announce_removed(self, tier: str, hashes: list[int]) -> None:
        if self.events is not None and hashes:
            self.events.removed(hashes, tier=tier)

    # --- up ---

    def prefetch(self, request_id: str, keys: list[BlockKey]) -> None:
        """Engine thread, as a request is queued: load and verify its blocks `keys` (those past its device hit, in
        chain order) on the mover, up to the first one no tier holds, as many as pay (OnboardPayoff.take)."""
        if not keys:
            return
        keys = keys[: self.max_prefetch_blocks]
        tiers = self._tiers_of(keys)
        taken = self.payoff.take(tiers)
        if not taken:
            self.prefetches.skip(request_id)
            return
        keys = keys[:taken]
        future = self.mover.load(lambda: {b.key.hash: b for b in self._load_run(keys)})
        self.prefetches.add(request_id, future, keys, tiers[:taken], self.on_loaded)

    def _tiers_of(self, keys: list[BlockKey]) -> list[str]:
        """The tier each key would come from (the disk for any the host tier lacks: a miss ends the run anyway)."""
        below = self.names[-1]
        if self.host is None:
            return [below] * len(keys)
        return [self.host.name if key.hash in self.host else below for key in keys]

    def ready(self, request_id: str) -> bool:
        """Whether admission may take the request now: no prefetch of it runs, or its prefetch ended, or it has been
        held for it as long as computing its blocks would take. Admitting it while its blocks still load would hold
        the engine thread, and with it every running request's next token, until the disk answers."""
        return self.prefetches.ready(request_id, self.FETCH_WAIT_S)

    def wait_left_s(self) -> float | None:
        """Seconds until the first request admission holds for its prefetch may be admitted anyway (None: none is
        held): how long an engine with nothing else to run may sleep."""
        return self.prefetches.wait_left_s()

    def fetch(self, request_id: str, keys: list[BlockKey], limit: int) -> list[StoredBlock]:
        """Engine thread, at admission: the verified blocks of the longest run of `keys` (at most `limit`) the tiers
        hold, those staged by `prefetch` first; none where the hit did not pay or the prefetch is late (computed)."""
        started = time.perf_counter()
        staged = self.prefetches.take(request_id)
        if staged.compute:
            return []
        if staged.blocks is None:  # no prefetch ran for it (a preempted request, or the device held them then)
            keys = keys[: self.payoff.take(self._tiers_of(keys[:limit]))]
        else:  # up to the last the prefetch was asked for: the blocks after it did not pay
            keys = keys[: next((i + 1 for i, key in enumerate(keys) if key.hash == staged.last), len(keys))]
        found = self._load_run(keys[:limit], staged.blocks)
        if found:
            share = (staged.held_s + time.perf_counter() - started) / len(found)
            for block in found:
                block.wait_s = share
        return found

    def install(self, block_ids: list[int], blocks: list[StoredBlock]) -> None:
        """Copy fetched blocks into these device blocks (on the engine's stream: before any step that reads them)."""
        started, n = time.perf_counter(), len(block_ids)
        if self._pinned:
            shape = (n, *self.cache_bytes[:, :, 0].shape)
            values = self._upload([b.payload for b in blocks]).view(shape).permute(1, 2, 0, 3, 4, 5)
            self.cache_bytes.index_copy_(2, self._indices(block_ids), values)
        else:  # the device is host memory: each payload straight into its block, one copy
            shape = self.cache_bytes[:, :, 0].shape
            for block_id, block in zip(block_ids, blocks):
                self.cache_bytes[:, :, block_id].copy_(block.payload.view(shape))
        share = (time.perf_counter() - started) / n
        by_tier: dict[str, list[StoredBlock]] = {}
        for block_id, block in zip(block_ids, blocks):
            self._keys[block_id] = block.key
            if self.write_through and block.tier == self.disk.name:
                self._written.add(block_id)  # the node's tier holds it already
            else:
                self._written.discard(block_id)
            by_tier.setdefault(block.tier, []).append(block)
        for tier, got in by_tier.items():
            self.metrics.hit(tier, len(got), len(got) * self.layout.block_size, len(got) * self.block_bytes,
                             sum(b.load_s for b in got) + share * len(got))
            self.payoff.onboarded(tier, len(got), sum(b.wait_s for b in got) + share * len(got))

    def _upload(self, payloads: list[torch.Tensor]) -> torch.Tensor:
        """The payloads as one [n, block_bytes] tensor on the GPU, enqueued on the engine's stream. A pinned
        payload (the host tier's) goes up by a DMA of its own, with no copy on the engine thread; the others (the
        disk's) are gathered into pinned memory first, one copy, and go up together."""
        out = torch.empty((len(payloads), self.block_bytes), dtype=torch.uint8, device=self.device)
        gathered = []
        for i, payload in enumerate(payloads):
            if payload.is_pinned():
                out[i].copy_(payload, non_blocking=True)
            else:
                gathered.append(i)
        if gathered:
            rows = torch.empty((len(gathered), self.block_bytes), dtype=torch.uint8, pin_memory=True)
            torch.stack([payloads[i] for i in gathered], out=rows)
            out.index_copy_(0, self._indices(gathered), rows.to(self.device, non_blocking=True))
        return out

    def _indices(self, ids: list[int]) -> torch.Tensor:
        """`ids` as a device tensor, sent up without waiting: torch.tensor(ids, device=...) copies from pageable
        memory and waits for the engine's stream, the step in flight with it."""
        return torch.tensor(ids, dtype=torch.long, pin_memory=self._pinned).to(self.device, non_blocking=True)

    def _load_run(self, keys: list[BlockKey], staged: dict[int, StoredBlock] | None = None) -> list[StoredBlock]:
        """The blocks of `keys` up to the first no tier holds: `staged`'s where it has the same key, else loaded."""
        found = []
        for key in keys:
            block = staged.get(key.hash) if staged else None
            if block is None or block.key != key:
                block = self._load(key)
            if block is None:
                break
            found.append(block)
        return found

    def _load(self, key: BlockKey) -> StoredBlock | None:
        """`key`'s block from the highest tier holding it, verified (a block that fails is dropped there, counted,
        and looked for below), or None."""
        started = time.perf_counter()
        block = self._from_host(key) if self.host is not None else None
        if block is None and self.disk is not None:
            block = self._from_disk(key)
        if block is not None:
            block.load_s = time.perf_counter() - started
        return block

    def _from_host(self, key: BlockKey) -> StoredBlock | None:
        block = self.host.get(key.hash)
        return block if block is not None and self._passes(block, key, self.host) else None

    def _from_disk(self, key: BlockKey) -> StoredBlock | None:
        data = self.disk.read(key.hash)
        if data is None:
            return None
        try:
            block = decode(data, self.layout, self.disk.name)
        except RecordRejected as exc:
            self._reject(self.disk, key, exc)
            return None
        return block if self._passes(block, key, self.disk) else None

    def _passes(self, block: StoredBlock, key: BlockKey, tier) -> bool:
        try:
            block.verify(key, self.block_bytes)
        except RecordRejected as exc:
            self._reject(tier, key, exc)
            return False
        return True

    def _reject(self, tier, key: BlockKey, exc: RecordRejected) -> None:
        log.warning("KV %s tier: block %016x failed its check (%s); recomputing it", tier.name, key.hash, exc)
        self.metrics.rejected(tier.name, exc.reason)
        tier.discard(key.hash)
        self._announce_removed(tier.name, [key.hash])

    def close(self) -> None:
        self.mover.close()

"""KV cache events: what entered and left a worker's prefix cache, and the tiers below it, for KV-aware routing.

The block manager reports on the engine thread (`stored`, `removed`, `cleared`), the KV tiers (common/kv/tiers) on
theirs with the tier named (`stored(..., tier="disk")`: a block the worker can onboard instead of computing);
subscribers read
from their own bounded queue on an asyncio loop. A subscriber's messages are numbered 1, 2, 3, ...
starting with a snapshot (AllCleared, then one BlockStored per cached block); an event that does
not fit its queue is dropped but still takes a number, so the subscriber sees the gap and
resubscribes (Dynamo's KV event publishers number events the same way).
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

EventBody = tuple  # ("stored", hashes, parent | None, num_tokens, tier) | ("removed", hashes, tier) | ("cleared",)
#                    | ("hit_cost", tier, cost)
QUEUE_LIMIT = 10_000
DEVICE = "device"  # the tier of the device pool's prefix cache; the others are the tiers' names ("host", "disk")


@dataclass
class Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(QUEUE_LIMIT))
    next_sequence: int = 1

    def offer(self, body: EventBody) -> None:
        """Called on the engine thread; numbering happens here so a drop shows as a gap."""
        sequence = self.next_sequence
        self.next_sequence += 1
        self.loop.call_soon_threadsafe(self._put, sequence, body)

    def _put(self, sequence: int, body: EventBody) -> None:
        try:
            self.queue.put_nowait((sequence, body))
        except asyncio.QueueFull:
            pass  # dropped: the next message the subscriber reads has a later number


class KvEventLog:
    """The block manager's event sink; also remembers each cached hash's parent for snapshots."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # tier → cached block hash → parent hash (None: a first block)
        self._parents: dict[str, dict[int, int | None]] = {DEVICE: {}}
        self._costs: dict[str, float] = {}  # tier → the last hit cost reported (hit_cost)
        self._subscribers: list[Subscriber] = []
        # The tables, the subscribers and their numbering: the tiers report from their own thread.
        self._lock = threading.Lock()

    # --- from the block manager (engine thread) and the tiers (their thread) ---

    def stored(self, hashes: list[int], parent: int | None, tier: str = DEVICE) -> None:
        if not hashes:
            return
        with self._lock:
            table = self._parents.setdefault(tier, {})
            previous = parent
            for h in hashes:
                table[h] = previous
                previous = h
            self._publish(("stored", list(hashes), parent, len(hashes) * self.block_size, tier))

    def removed(self, hashes: list[int], tier: str = DEVICE) -> None:
        if not hashes:
            return
        with self._lock:
            table = self._parents.get(tier, {})
            for h in hashes:
                table.pop(h, None)
            self._publish(("removed", list(hashes), tier))

    def hit_cost(self, tier: str, cost: float) -> None:
        """What a hit in `tier` costs against computing the block, as the worker measured it (the router's weight)."""
        with self._lock:
            self._costs[tier] = cost
            self._publish(("hit_cost", tier, cost))

    def cleared(self) -> None:
        """The device pool's prefix cache was emptied: subscribers forget everything, then hear the tiers again."""
        with self._lock:
            self._parents[DEVICE].clear()
            self._publish(("cleared",))
            for tier, table in self._parents.items():
                for h, parent in table.items():
                    self._publish(("stored", [h], parent, self.block_size, tier))

    # --- subscriptions ---

    def subscribe(self, loop: asyncio.AbstractEventLoop) -> Subscriber:
        """Call on the engine thread (AsyncLLMEngine.call), so no event slips between snapshot and live."""
        with self._lock:  # snapshot and subscription under the lock: a tier's event lands in one of them
            tables = [(tier, list(table.items())) for tier, table in self._parents.items()]
            # Room for the whole snapshot on top of the live bound: a big cache must not gap by itself.
            size = QUEUE_LIMIT + sum(len(t) for _, t in tables) + len(self._costs) + 1
            subscriber = Subscriber(loop, asyncio.Queue(size))
            subscriber.offer(("cleared",))
            for tier, items in tables:
                for h, parent in items:
                    subscriber.offer(("stored", [h], parent, self.block_size, tier))
            for tier, cost in self._costs.items():
                subscriber.offer(("hit_cost", tier, cost))
            self._subscribers.append(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        with self._lock:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

    @property
    def num_cached(self) -> int:
        """Blocks in the device pool's prefix cache."""
        return len(self._parents[DEVICE])

    def num_in(self, tier: str) -> int:
        return len(self._parents.get(tier, ()))

    def _publish(self, body: EventBody) -> None:
        """With the lock held: the engine thread and the tiers' both report, and each subscriber's numbers and
        order must be one sequence."""
        for subscriber in self._subscribers:
            subscriber.offer(body)

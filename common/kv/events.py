"""KV cache events: what entered and left a worker's prefix cache, for KV-aware routing.

The block manager reports on the engine thread (`stored`, `removed`, `cleared`); subscribers read
from their own bounded queue on an asyncio loop. A subscriber's messages are numbered 1, 2, 3, ...
starting with a snapshot (AllCleared, then one BlockStored per cached block); an event that does
not fit its queue is dropped but still takes a number, so the subscriber sees the gap and
resubscribes (Dynamo's KV event publishers number events the same way).
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

EventBody = tuple  # ("stored", hashes, parent | None, num_tokens) | ("removed", hashes) | ("cleared",)
QUEUE_LIMIT = 10_000


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
        self._parents: dict[int, int | None] = {}  # cached block hash → parent hash (None: a first block)
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()

    # --- from the block manager (engine thread) ---

    def stored(self, hashes: list[int], parent: int | None) -> None:
        if not hashes:
            return
        previous = parent
        for h in hashes:
            self._parents[h] = previous
            previous = h
        self._publish(("stored", list(hashes), parent, len(hashes) * self.block_size))

    def removed(self, hashes: list[int]) -> None:
        if not hashes:
            return
        for h in hashes:
            self._parents.pop(h, None)
        self._publish(("removed", list(hashes)))

    def cleared(self) -> None:
        self._parents.clear()
        self._publish(("cleared",))

    # --- subscriptions ---

    def subscribe(self, loop: asyncio.AbstractEventLoop) -> Subscriber:
        """Call on the engine thread (AsyncLLMEngine.call), so no event slips between snapshot and live."""
        # Room for the whole snapshot on top of the live bound: a big cache must not gap by itself.
        subscriber = Subscriber(loop, asyncio.Queue(QUEUE_LIMIT + len(self._parents) + 1))
        subscriber.offer(("cleared",))
        for h, parent in self._parents.items():
            subscriber.offer(("stored", [h], parent, self.block_size))
        with self._lock:
            self._subscribers.append(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        with self._lock:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

    @property
    def num_cached(self) -> int:
        return len(self._parents)

    def _publish(self, body: EventBody) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for subscriber in subscribers:
            subscriber.offer(body)

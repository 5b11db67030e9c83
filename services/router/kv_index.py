"""Beside the request path (the kv_aware policy reads it): which prefixes each worker's prefix cache holds, fed by its
Worker.SubscribeKvEvents stream.

Hashes are the engine's own chained block hashes (common.kv.block_hash.hash_blocks), so a
prompt's hashes computed here name the same blocks the workers announce. A subscription that breaks
(worker gone, restarted) or shows a sequence gap (events dropped) clears that worker's entry and
resubscribes: the new stream starts with a snapshot, so the index re-syncs without guessing.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from common.pb.disagg.v1 import worker_pb2

log = logging.getLogger(__name__)
_RETRY_S = (0.2, 1.0)  # a restarted worker is followed again within a second of serving


class KvIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, set[int]] = {}  # worker endpoint → cached block hashes
        self._followers: dict[str, asyncio.Task] = {}

    def apply(self, endpoint: str, event: worker_pb2.KvEvent) -> None:
        blocks = self._blocks.setdefault(endpoint, set())
        kind = event.WhichOneof("event")
        if kind == "stored":
            blocks.update(event.stored.block_hashes)
        elif kind == "removed":
            blocks.difference_update(event.removed.block_hashes)
        elif kind == "cleared":
            blocks.clear()

    def reset(self, endpoint: str) -> None:
        self._blocks.pop(endpoint, None)

    def num_blocks(self, endpoint: str) -> int:
        return len(self._blocks.get(endpoint, ()))

    def overlap_blocks(self, endpoint: str, prompt_hashes: list[int]) -> int:
        """How many leading blocks of the prompt the worker holds (a chained hash implies its whole prefix)."""
        blocks = self._blocks.get(endpoint, set())
        count = 0
        for h in prompt_hashes:
            if h not in blocks:
                break
            count += 1
        return count

    # --- subscriptions ---

    def follow(self, worker) -> None:
        """Keep a subscription to the worker (a services.router.workers.WorkerClient) until `unfollow` or `close`."""
        task = self._followers.get(worker.endpoint)
        if task is None or task.done():
            self._followers[worker.endpoint] = asyncio.get_running_loop().create_task(self._follow(worker))

    def unfollow(self, endpoint: str) -> None:
        """Stop following the worker (it left) and forget what it held."""
        task = self._followers.pop(endpoint, None)
        if task is not None:
            task.cancel()
        self.reset(endpoint)

    async def close(self) -> None:
        for task in self._followers.values():
            task.cancel()
        await asyncio.gather(*self._followers.values(), return_exceptions=True)

    async def _follow(self, worker) -> None:
        delay = _RETRY_S[0]
        while True:
            expected = 1
            try:
                async for event in worker.worker.SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest()):
                    if event.sequence != expected:
                        log.warning("KV events from %s jumped from %d to %d (dropped); resubscribing",
                                    worker.endpoint, expected, event.sequence)
                        break
                    expected += 1
                    self.apply(worker.endpoint, event)
                    delay = _RETRY_S[0]
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("worker %s publishes no KV events (%s)", worker.endpoint, exc.details())
                    self.reset(worker.endpoint)
                    return
                log.info("KV events from %s ended (%s); resubscribing in %.1fs", worker.endpoint, exc.code().name, delay)
            self.reset(worker.endpoint)  # whatever it holds now comes with the next snapshot
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_S[1])


"""Beside the request path (the kv_aware policy reads it): which prefixes each worker's prefix cache holds, and the
tiers below it (host memory, disk), fed by its Worker.SubscribeKvEvents stream.

A prompt's leading blocks count where the worker holds them, each by where: a device block is a whole block the
worker need not compute, a lower tier's counts 1 - its hit cost (what onboarding it costs against computing it, as
the worker measured and reported it; DEFAULT_HIT_COST until it has), so a lower-tier hit scores below a device hit
and above a miss.

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
DEVICE = worker_pb2.KV_TIER_DEVICE  # (a worker that names no tier, KV_TIER_UNSPECIFIED, means it too)
DEFAULT_HIT_COST = 0.5  # a lower tier's hit before its worker has measured one: half a computed block
_MIN_HIT_COST, _MAX_HIT_COST = 0.01, 0.99  # a lower tier's hit stays below a device hit and above a miss


class KvIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, dict[int, set[int]]] = {}  # worker endpoint → tier → block hashes held there
        self._costs: dict[str, dict[int, float]] = {}  # worker endpoint → tier → its reported hit cost
        self._followers: dict[str, asyncio.Task] = {}

    def apply(self, endpoint: str, event: worker_pb2.KvEvent) -> None:
        tiers = self._blocks.setdefault(endpoint, {DEVICE: set()})
        kind = event.WhichOneof("event")
        if kind == "stored":
            tiers.setdefault(event.stored.tier or DEVICE, set()).update(event.stored.block_hashes)
        elif kind == "removed":
            tiers.get(event.removed.tier or DEVICE, set()).difference_update(event.removed.block_hashes)
        elif kind == "cleared":
            tiers.clear()
            tiers[DEVICE] = set()
        elif kind == "hit_cost":
            self._costs.setdefault(endpoint, {})[event.hit_cost.tier] = event.hit_cost.cost

    def reset(self, endpoint: str) -> None:
        self._blocks.pop(endpoint, None)
        self._costs.pop(endpoint, None)

    def num_blocks(self, endpoint: str, tier: int = DEVICE) -> int:
        return len(self._blocks.get(endpoint, {}).get(tier, ()))

    def hit_cost(self, endpoint: str, tier: int) -> float:
        """What a hit in `tier` costs the worker against computing the block (0 on the device)."""
        if tier == DEVICE:
            return 0.0
        cost = self._costs.get(endpoint, {}).get(tier, DEFAULT_HIT_COST)
        return min(max(cost, _MIN_HIT_COST), _MAX_HIT_COST)

    def overlap_blocks(self, endpoint: str, prompt_hashes: list[int]) -> float:
        """The prompt's leading blocks the worker holds in any tier (a chained hash implies its whole prefix), each
        counted 1 - its tier's hit cost: a device block 1, a lower tier's less."""
        # the device first, then host, then disk: a block counts where it is best
        ordered = [(blocks, 1 - self.hit_cost(endpoint, tier))
                   for tier, blocks in sorted(self._blocks.get(endpoint, {}).items())]
        count = 0.0
        for h in prompt_hashes:
            weight = next((w for blocks, w in ordered if h in blocks), None)
            if weight is None:
                break
            count += weight
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


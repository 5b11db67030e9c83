"""How the router picks one worker of a role: round_robin, least_loaded (Worker.GetLoad), or kv_aware
(prefill workers by cached prefix against load, from their KV events; decode workers by load)."""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Protocol

import grpc

from common.discovery import Role
from common.kv.block_hash import hash_blocks
from common.pb.disagg.v1 import worker_pb2
from services.router.kv_index import KvIndex
from services.router.workers import WorkerClient

log = logging.getLogger(__name__)

_GET_LOAD_TIMEOUT_S = 0.5


class Policy(Protocol):
    async def pick(self, workers: list[WorkerClient], prompt: list[int] | None = None) -> WorkerClient:
        """One of `workers` (never empty); `prompt` is the request's token ids, for policies that use it."""


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    async def pick(self, workers: list[WorkerClient], prompt: list[int] | None = None) -> WorkerClient:
        ordered = sorted(workers, key=lambda w: w.endpoint)
        return ordered[next(self._counter) % len(ordered)]


def load_score(load: worker_pb2.Load, inflight: int) -> float:
    """Queued and running requests first; KV usage (in [0, 1]) breaks ties between equal queues.

    The worker has at least the requests this router has on it (`inflight`), even those that
    have not reached it yet: picks racing each other then spread instead of piling onto the
    worker that looked idle.
    """
    return max(load.running_requests + load.waiting_requests, inflight) + load.kv_usage_ratio


class LeastLoaded:
    """Asks every candidate for its load; a worker that does not answer in time is passed over."""

    async def pick(self, workers: list[WorkerClient], prompt: list[int] | None = None) -> WorkerClient:
        loads = await asyncio.gather(*(fetch_load(w) for w in workers))
        scored = [(load_score(load, w.inflight), w.endpoint, w) for w, load in zip(workers, loads)
                  if load is not None]
        if not scored:
            return min(workers, key=lambda w: (w.inflight, w.endpoint))
        return min(scored, key=lambda s: s[:2])[2]


async def fetch_load(worker: WorkerClient) -> worker_pb2.Load | None:
    """The worker's GetLoad, or None when it does not answer in time."""
    try:
        return await worker.worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=_GET_LOAD_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        log.debug("GetLoad on %s failed: %s", worker.endpoint, exc.code().name)
        return None


@dataclass(frozen=True)
class KvAwareWeights:
    overlap: float = 1.0
    """Cost of one prompt block the worker must compute (Dynamo's prefill_load_scale)."""
    load: float = 1.0
    """Cost of one block of prefill already queued on the worker by this router."""


class KvAware:
    """Prefill worker with the lowest cost = overlap·max(new_blocks − cached_blocks, 0) + load·queued_blocks.

    cached_blocks comes from the worker's KV events (KvIndex); queued_blocks is the prefill work this
    router has in flight there, so a popular prefix cannot pile every request onto one worker.
    """

    def __init__(self, index: KvIndex, weights: KvAwareWeights = KvAwareWeights()):
        self.index = index
        self.weights = weights

    def cached_tokens(self, worker: WorkerClient, prompt: list[int]) -> int:
        """The prompt tokens the worker's prefix cache holds, as far as its events tell."""
        block_size = worker.info.block_size
        return self.index.overlap_blocks(worker.endpoint, hash_blocks(prompt, block_size)) * block_size

    def cost(self, worker: WorkerClient, prompt: list[int]) -> float:
        block_size = worker.info.block_size
        new_blocks = max(-(-len(prompt) // block_size) - self.cached_tokens(worker, prompt) // block_size, 0)
        queued_blocks = worker.pending_prefill_tokens / block_size
        return self.weights.overlap * new_blocks + self.weights.load * queued_blocks

    async def pick(self, workers: list[WorkerClient], prompt: list[int] | None = None) -> WorkerClient:
        if prompt is None:
            return min(workers, key=lambda w: (w.pending_prefill_tokens, w.endpoint))
        return min(workers, key=lambda w: (self.cost(w, prompt), w.endpoint))


POLICIES = ("round_robin", "least_loaded", "kv_aware")


def make_policy(name: str, role: Role, index: KvIndex | None = None,
                weights: KvAwareWeights = KvAwareWeights()) -> Policy:
    """kv_aware routes prefill (and encode-less aggregated requests go by load); other roles go by load."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded" or role is not Role.PREFILL:
        return LeastLoaded()
    return KvAware(index if index is not None else KvIndex(), weights)

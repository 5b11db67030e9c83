"""How the router picks one worker of a role: round_robin or least_loaded (Worker.GetLoad)."""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Protocol

import grpc

from common.pb.disagg.v1 import worker_pb2
from services.router.workers import WorkerClient

log = logging.getLogger(__name__)

_GET_LOAD_TIMEOUT_S = 0.5


class Policy(Protocol):
    async def pick(self, workers: list[WorkerClient]) -> WorkerClient:
        """One of `workers` (never empty)."""


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    async def pick(self, workers: list[WorkerClient]) -> WorkerClient:
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

    async def pick(self, workers: list[WorkerClient]) -> WorkerClient:
        loads = await asyncio.gather(*(self._load(w) for w in workers))
        scored = [(load_score(load, w.inflight), w.endpoint, w) for w, load in zip(workers, loads)
                  if load is not None]
        if not scored:
            return min(workers, key=lambda w: (w.inflight, w.endpoint))
        return min(scored, key=lambda s: s[:2])[2]

    async def _load(self, worker: WorkerClient) -> worker_pb2.Load | None:
        try:
            return await worker.worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=_GET_LOAD_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.debug("GetLoad on %s failed: %s", worker.endpoint, exc.code().name)
            return None


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}


def make_policy(name: str) -> Policy:
    return POLICIES[name]()

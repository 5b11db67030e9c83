"""least_loaded: the worker with the fewest queued and running requests (Worker.GetLoad)."""
from __future__ import annotations

import asyncio
import logging
from typing import ClassVar

import grpc

from common.discovery import Role
from common.pb.disagg.v1 import worker_pb2
from services.router.policies import Policy, PolicyContext
from services.router.workers import WorkerClient

log = logging.getLogger(__name__)

_GET_LOAD_TIMEOUT_S = 0.5


def load_score(load: worker_pb2.Load, inflight: int) -> float:
    """Queued and running requests first; KV usage (in [0, 1]) breaks ties between equal queues.

    The worker has at least the requests this router has on it (`inflight`), even those that
    have not reached it yet: picks racing each other then spread instead of piling onto the
    worker that looked idle.
    """
    return max(load.running_requests + load.waiting_requests, inflight) + load.kv_usage_ratio


class LeastLoaded:
    """Asks every candidate for its load; a worker that does not answer in time is passed over."""

    needs_kv_index: ClassVar[bool] = False

    @classmethod
    def for_role(cls, role: Role, context: PolicyContext) -> Policy:
        return cls()

    async def pick(self, workers: list[WorkerClient], prompt: list[int] | None = None) -> WorkerClient:
        if len(workers) == 1:  # nothing to choose between: no GetLoad round trip on the request's path
            return workers[0]
        loads = await asyncio.gather(*(fetch_load(w) for w in workers))
        scored = [(load_score(load, w.inflight), w.endpoint, w) for w, load in zip(workers, loads)
                  if load is not None]
        if not scored:
            return min(workers, key=lambda w: (w.inflight, w.endpoint))
        return min(scored, key=lambda s: s[:2])[2]

    def cached_tokens(self, worker: WorkerClient, prompt: list[int]) -> int | None:
        return None


async def fetch_load(worker: WorkerClient) -> worker_pb2.Load | None:
    """The worker's GetLoad, or None when it does not answer in time."""
    try:
        return await worker.worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=_GET_LOAD_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        log.debug("GetLoad on %s failed: %s", worker.endpoint, exc.code().name)
        return None

"""Worker choice: round_robin cycles; least_loaded asks GetLoad and spreads racing picks."""
import asyncio

import grpc

from common.discovery import Role
from common.pb.disagg.v1 import worker_pb2
from services.router import policies
from services.router.policies.least_loaded import LeastLoaded, load_score
from services.router.policies.round_robin import RoundRobin
from services.router.workers import WorkerClient


class _FakeWorkerStub:
    def __init__(self, load: worker_pb2.Load | None):
        self.load = load

    async def GetLoad(self, request, timeout=None):
        if self.load is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "down")
        return self.load


def _worker(endpoint: str, load: worker_pb2.Load | None = None, inflight: int = 0) -> WorkerClient:
    client = WorkerClient(Role.DECODE, endpoint, channel=grpc.aio.insecure_channel(endpoint), healthy=True,
                          inflight=inflight)
    client.worker = _FakeWorkerStub(load)
    return client


def test_round_robin_cycles_in_endpoint_order():
    async def picks():
        workers = [_worker("b:1"), _worker("a:1"), _worker("c:1")]
        policy = RoundRobin()
        return [(await policy.pick(workers)).endpoint for _ in range(4)]

    assert asyncio.run(picks()) == ["a:1", "b:1", "c:1", "a:1"]


def test_least_loaded_picks_the_shortest_queue():
    async def pick():
        workers = [_worker("a:1", worker_pb2.Load(running_requests=3)),
                   _worker("b:1", worker_pb2.Load(running_requests=1, waiting_requests=1)),
                   _worker("c:1", worker_pb2.Load(running_requests=1, kv_usage_ratio=0.5))]
        return (await LeastLoaded().pick(workers)).endpoint

    assert asyncio.run(pick()) == "c:1"


def test_least_loaded_skips_workers_that_do_not_answer():
    async def pick():
        workers = [_worker("a:1", None), _worker("b:1", worker_pb2.Load(running_requests=5))]
        return (await LeastLoaded().pick(workers)).endpoint

    assert asyncio.run(pick()) == "b:1"


def test_least_loaded_counts_requests_not_yet_seen_by_the_worker():
    idle = worker_pb2.Load()
    assert load_score(idle, inflight=2) == 2

    async def pick():
        workers = [_worker("a:1", idle, inflight=2), _worker("b:1", idle, inflight=1)]
        return (await LeastLoaded().pick(workers)).endpoint

    assert asyncio.run(pick()) == "b:1"


def test_every_registered_policy_builds_for_every_role():
    for name in policies.names():
        for role in Role:
            policy = policies.build(name, role, policies.PolicyContext())
            assert callable(policy.pick) and callable(policy.cached_tokens), (name, role)

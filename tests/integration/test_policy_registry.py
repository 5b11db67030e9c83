"""A routing policy is its own module plus one registry line: this test registers one (from here, touching no router
file) and the router takes it by name — the --policy flag (router and `disagg up`), the KV-event subscriptions it
asks for, the workers it picks, and the cached tokens it predicts for the prefill placement and the prefill call."""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import ClassVar

import grpc

from common.discovery import Role, StaticDiscovery
from common.engine.request import SamplingParams
from common.pb.disagg.v1 import worker_pb2
from services.router import policies
from services.router.config import RouterConfig, add_router_args
from services.router.deadline import Deadline
from services.router.disagg_decision import DisaggConfig, PrefillPlacement
from services.router.encode_prefill import EncodePrefill
from services.router.orchestrator import Orchestrator
from services.router.prepare import PreparedRequest
from services.router.server import worker_pool
from services.router.workers import WorkerClient
from services.cli.up import parse_args
from tests.integration.processes import REPO_ROOT


class LastByEndpoint:
    """Test policy: the worker whose endpoint sorts last; it claims every prompt's first 8 tokens are cached."""

    needs_kv_index: ClassVar[bool] = True

    def __init__(self, role: Role, context: policies.PolicyContext):
        self.role = role
        self.context = context

    @classmethod
    def for_role(cls, role: Role, context: policies.PolicyContext) -> "LastByEndpoint":
        return cls(role, context)

    async def pick(self, workers: list[WorkerClient], prompt: list[int] | None = None) -> WorkerClient:
        return max(workers, key=lambda w: w.endpoint)

    def cached_tokens(self, worker: WorkerClient, prompt: list[int]) -> int | None:
        return min(8, len(prompt))


policies.register("last_by_endpoint", LastByEndpoint)
policies.register("last_by_endpoint_lazy", "tests.integration.test_policy_registry:LastByEndpoint")


class _Pool:
    def __init__(self) -> None:
        self.kv_index = object()
        self.workers: list[WorkerClient] = []

    def ready(self, role: Role) -> list[WorkerClient]:
        return [w for w in self.workers if w.role is role]


def _worker(role: Role, endpoint: str) -> WorkerClient:
    info = worker_pb2.WorkerInfo(block_size=4, limits=worker_pb2.WorkerLimits(max_num_seqs=8))
    return WorkerClient(role, endpoint, channel=grpc.aio.insecure_channel(endpoint), info=info, healthy=True)


def test_a_registered_policy_is_a_choice_of_both_policy_flags():
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    assert parser.parse_args(["--policy", "last_by_endpoint"]).policy == "last_by_endpoint"
    assert parse_args(["--policy", "last_by_endpoint_lazy", "--model", "/m"]).policy == "last_by_endpoint_lazy"
    assert RouterConfig(model="/m", policy="last_by_endpoint").policy == "last_by_endpoint"


def test_a_policy_given_by_import_path_is_loaded_when_first_built():
    assert policies.factory_of("last_by_endpoint_lazy") is LastByEndpoint


def test_the_router_follows_kv_events_only_for_a_policy_that_needs_the_index():
    discovery = StaticDiscovery.from_flags({}, env={})
    assert worker_pool(RouterConfig(model="/m", policy="last_by_endpoint"), discovery).kv_index is not None
    assert worker_pool(RouterConfig(model="/m", policy="kv_aware"), discovery).kv_index is not None
    assert worker_pool(RouterConfig(model="/m", policy="round_robin"), discovery).kv_index is None


def test_the_router_picks_every_role_through_the_registered_policy():
    pool = _Pool()
    orchestrator = Orchestrator(pool, preparer=None, config=RouterConfig(model="/m", policy="last_by_endpoint",
                                                                         kv_overlap_weight=2.0))

    async def picks() -> list[str]:
        pool.workers = [_worker(role, f"{role.value}-{i}:1") for role in Role for i in range(3)]
        return [(await orchestrator._pick(role, [1, 2, 3])).endpoint for role in Role]

    assert asyncio.run(picks()) == [f"{role.value}-2:1" for role in Role]
    built = orchestrator._policies[Role.PREFILL]
    assert built.context.kv_index is pool.kv_index and built.context.kv_overlap_weight == 2.0


def test_the_prefill_placement_counts_what_the_policy_predicts_as_cached():
    policy = LastByEndpoint(Role.PREFILL, policies.PolicyContext())
    placement = PrefillPlacement(DisaggConfig(max_local_prefill_tokens=4), policy)

    async def remote(prompt_len: int) -> bool:
        decode, prefill = _worker(Role.DECODE, "d:1"), _worker(Role.PREFILL, "p:1")

        async def pick() -> WorkerClient:
            return prefill

        return await placement.place(list(range(prompt_len)), decode, pick) is prefill

    assert asyncio.run(remote(12)) is False  # 4 uncached after the 8 the policy says decode holds
    assert asyncio.run(remote(13)) is True


def test_the_prefill_call_charges_the_prefill_worker_only_what_the_policy_predicts_uncached():
    policy = LastByEndpoint(Role.PREFILL, policies.PolicyContext())
    calls = EncodePrefill(pool=None, prefill_policy=policy, policy_name="last_by_endpoint")
    request = PreparedRequest("r", "r-1", prompt=list(range(12)), max_model_len=64, params=SamplingParams())
    charged: list[int] = []

    async def prefill() -> tuple[int, int]:
        worker = _worker(Role.PREFILL, "p:1")

        async def call(request, timeout=None) -> worker_pb2.PrefillResponse:
            charged.append(worker.pending_prefill_tokens)  # while the call runs
            return worker_pb2.PrefillResponse(first_token=3)

        worker.prefiller = SimpleNamespace(Prefill=call)
        ready = await calls.prefill(worker, request, Deadline.of(0, None))
        return ready.first_token, worker.pending_prefill_tokens

    assert asyncio.run(prefill()) == (3, 0)
    assert charged == [4]  # 12 prompt tokens less the 8 the policy says the worker caches


def test_a_router_process_takes_a_policy_from_a_module_named_in_the_environment():
    env = {**os.environ, policies.MODULES_ENV: "tests.integration.test_policy_registry"}
    # a fresh process: the policy is known only through the module the environment names
    parse = ("import argparse; from services.router.config import add_router_args; "
             "parser = argparse.ArgumentParser(); add_router_args(parser); "
             "print(parser.parse_args(['--policy', 'last_by_endpoint']).policy)")
    result = subprocess.run([sys.executable, "-c", parse], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.split() == ["last_by_endpoint"], result.stdout + result.stderr

"""Static discovery: endpoints from flags or env, validated, and a watch that yields the fixed view."""
import asyncio

import pytest

from common.discovery import Role, StaticDiscovery, parse_endpoints
from common.errors import InvalidConfig


def test_parse_endpoints_splits_trims_and_dedupes():
    assert parse_endpoints(" a:1, b:2,,a:1 ", "--x") == ["a:1", "b:2"]
    assert parse_endpoints(None, "--x") == []
    assert parse_endpoints("[::1]:50051", "--x") == ["[::1]:50051"]


@pytest.mark.parametrize("bad", ["host", "host:", ":80", "host:0", "host:70000", "host:http"])
def test_parse_endpoints_rejects_bad_items_naming_the_source(bad):
    with pytest.raises(InvalidConfig, match=r"--decode-workers: expected host:port"):
        parse_endpoints(bad, "--decode-workers")


def test_flag_wins_over_env_and_env_fills_the_rest():
    env = {"DISAGG_PREFILL_WORKERS": "p:1", "DISAGG_DECODE_WORKERS": "d:1,d:2"}
    discovery = StaticDiscovery.from_flags({Role.PREFILL: "p:9", Role.DECODE: None}, env)
    assert asyncio.run(discovery.endpoints(Role.PREFILL)) == ["p:9"]
    assert asyncio.run(discovery.endpoints(Role.DECODE)) == ["d:1", "d:2"]


def test_bad_env_value_names_the_variable():
    with pytest.raises(InvalidConfig, match="env DISAGG_DECODE_WORKERS"):
        StaticDiscovery.from_flags({}, {"DISAGG_DECODE_WORKERS": "nope"})


def test_watch_yields_the_view_then_waits():
    discovery = StaticDiscovery({Role.DECODE: ["d:1"]})

    async def first_two():
        watch = discovery.watch(Role.DECODE)
        first = await anext(watch)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(anext(watch), 0.05)
        return first

    assert asyncio.run(first_two()) == ["d:1"]


class _RecordingIndex:
    """Records what the pool asks of its KvIndex (the real one would open SubscribeKvEvents streams)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def follow(self, worker) -> None:
        self.calls.append(("follow", worker.endpoint))

    def unfollow(self, endpoint: str) -> None:
        self.calls.append(("unfollow", endpoint))

    async def close(self) -> None:
        self.calls.append(("close", ""))


def test_the_pool_owns_kv_event_subscriptions_of_kv_workers():
    from common.pb.disagg.v1 import worker_pb2
    from services.router.workers import WorkerClient, WorkerPool

    async def scenario() -> list[tuple[str, str]]:
        index = _RecordingIndex()
        pool = WorkerPool(StaticDiscovery({}), kv_index=index)
        for role, endpoint, served in ((Role.PREFILL, "127.0.0.1:1", worker_pb2.WORKER_ROLE_PREFILL),
                                       (Role.ENCODE, "127.0.0.1:2", worker_pb2.WORKER_ROLE_ENCODE)):
            client = pool._clients[role][endpoint] = WorkerClient(role, endpoint, pool._channel(endpoint))
            pool._admit(client, worker_pb2.WorkerInfo(role=served, fingerprint="f"))
        pool._apply(Role.ENCODE, [])  # encode workers hold no KV: never followed, nothing to unfollow
        pool._apply(Role.PREFILL, [])  # the prefill worker left discovery
        await pool.close()
        return index.calls

    assert asyncio.run(scenario()) == [("follow", "127.0.0.1:1"), ("unfollow", "127.0.0.1:1"), ("close", "")]

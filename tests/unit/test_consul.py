"""common.discovery.consul against the Consul double, driven through py-consul: the registration's shape,
the GRPC check the double runs, blocking queries that follow health changes, and clean-up of a crashed service."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
import time
from functools import partial
from typing import AsyncIterator

import consul
import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.discovery import Role
from common.discovery.consul import (ConsulDiscovery, ConsulSettings, ServiceRegistration, add_consul_args,
                                     consul_from_args)
from tests.consul_double import ConsulDouble, parse_duration
from tests.loopback_grpc import loopback_server


@contextlib.asynccontextmanager
async def health_server() -> AsyncIterator[tuple[int, health.aio.HealthServicer, grpc.aio.Server]]:
    servicer = health.aio.HealthServicer()
    async with loopback_server(partial(health_pb2_grpc.add_HealthServicer_to_server, servicer)) as (server, address):
        yield int(address.rsplit(":", 1)[1]), servicer, server


def _settings(consul_double: ConsulDouble, **kwargs) -> ConsulSettings:
    return ConsulSettings(address=consul_double.address, check_interval="100ms", check_timeout="1s", wait="2s", **kwargs)


async def _next(views: AsyncIterator[list[str]], timeout_s: float = 5.0) -> list[str]:
    return await asyncio.wait_for(anext(views), timeout_s)


def test_registration_has_the_documented_shape_and_a_native_grpc_check(consul_double):
    async def main() -> None:
        async with health_server() as (port, servicer, _):
            registration = ServiceRegistration(_settings(consul_double, deregister_after="90s"), "decode", "127.0.0.1", port,
                                               tags=["role=decode", "model=m"], meta={"block_size": "16"})
            await registration.register()
            agent = consul.Consul(host="127.0.0.1", port=int(consul_double.address.split(":")[1])).agent
            service = agent.services()[registration.service_id]
            assert (service["Service"], service["Address"], service["Port"]) == ("disagg-decode", "127.0.0.1", port)
            assert service["Tags"] == ["role=decode", "model=m"] and service["Meta"] == {"block_size": "16"}
            (check,) = [c for c in consul_double.checks.values() if c.service_id == registration.service_id]
            assert (check.grpc_target, check.interval_s, check.deregister_after_s) == (f"127.0.0.1:{port}", 0.1, 90.0)
            # critical until the first run; the health servicer's overall status is SERVING
            await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            deadline = time.monotonic() + 15  # the double's first gRPC check, on a loaded machine
            while agent.checks()[check.check_id]["Status"] != "passing" and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert agent.checks()[check.check_id]["Status"] == "passing"
            await registration.deregister()
            assert agent.services() == {} and agent.checks() == {}

    asyncio.run(main())


def test_watch_follows_checks_through_blocking_queries(consul_double):
    async def main() -> None:
        async with health_server() as (port, servicer, _):
            await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            settings = _settings(consul_double)
            views = ConsulDiscovery(settings).watch(Role.DECODE)
            assert await _next(views) == []  # the current view first
            await ServiceRegistration(settings, "decode", "127.0.0.1", port).register()
            await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            assert await _next(views) == [f"127.0.0.1:{port}"]
            before = len(consul_double.requests)
            await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            assert await _next(views) == []
            queries = [q for _, path, q in consul_double.requests[before:] if path == "/v1/health/service/disagg-decode"]
            assert queries and all("passing" in q and "index=" in q and "wait=2s" in q for q in queries)
            assert len(queries) <= 3, "a blocking query waits for a change instead of polling"
            await views.aclose()

    asyncio.run(main())


def test_a_router_stops_while_its_blocking_query_still_waits(consul_double):
    """The watch's blocking query runs in a daemon thread: closing the watch (a router stopping) does not wait for
    the query's `wait` to run out, as a thread of asyncio's executor would at the loop's shutdown."""
    settings = ConsulSettings(address=consul_double.address, wait="60s")

    async def main() -> None:
        views = ConsulDiscovery(settings).watch(Role.DECODE)
        assert await _next(views) == []
        waiting = asyncio.create_task(anext(views))  # the blocking query that follows: nothing will change
        for _ in range(250):
            if any("wait=60s" in q for _, _, q in consul_double.requests):
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the blocking query never reached the Consul double")
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await views.aclose()

    asyncio.run(main())  # returns with the query still open
    assert any(t.name == "consul-blocking-query" and t.is_alive() and t.daemon for t in threading.enumerate())


def test_a_crashed_service_leaves_the_catalog_after_deregister_critical_service_after(consul_double):
    async def main() -> str:
        async with health_server() as (port, servicer, server):
            await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            registration = ServiceRegistration(_settings(consul_double, deregister_after="500ms"), "prefill", "127.0.0.1", port)
            await registration.register()
            deadline = time.monotonic() + 15  # the double's first gRPC check, on a loaded machine
            while not consul_double.health("disagg-prefill", passing=True) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert consul_double.health("disagg-prefill", passing=True)
            await server.stop(None)  # gone without deregistering
            return registration.service_id

    service_id = asyncio.run(main())
    deadline = time.monotonic() + 15
    while service_id in consul_double.services and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service_id not in consul_double.services and not consul_double.checks


def test_blocking_query_returns_at_wait_with_the_same_index(consul_double):
    client = consul.Consul(host="127.0.0.1", port=int(consul_double.address.split(":")[1]))
    index, entries = client.health.service("disagg-decode", passing=True)
    started = time.monotonic()
    again, entries = client.health.service("disagg-decode", passing=True, index=index, wait="300ms")
    assert (again, entries) == (index, []) and 0.25 < time.monotonic() - started < 2


def test_consul_is_off_unless_asked_and_reads_the_standard_variables(monkeypatch):
    parser = argparse.ArgumentParser()
    add_consul_args(parser)
    assert consul_from_args(parser.parse_args([]), env={}) is None
    assert consul_from_args(parser.parse_args([]), env={"DISAGG_CONSUL": "1"}) == ConsulSettings()
    on = consul_from_args(parser.parse_args(["--consul-addr", "https://consul.example:8501", "--consul-check-interval",
                                             "5s"]), env={})
    assert (on.address, on.check_interval, on.check_timeout) == ("https://consul.example:8501", "5s", "5s")
    assert on.client().http.base_uri == "https://consul.example:8501"
    monkeypatch.setenv("CONSUL_HTTP_ADDR", "10.0.0.9:8500")
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", "secret")
    client = ConsulSettings().client()
    assert (client.http.base_uri, client.token) == ("http://10.0.0.9:8500", "secret")


def test_durations_parse_as_consul_writes_them():
    assert [parse_duration(t, 0) for t in ("250ms", "2s", "1.5m", "1h")] == [0.25, 2.0, 90.0, 3600.0]
    assert parse_duration(None, 7.0) == 7.0
    with pytest.raises(ValueError):
        parse_duration("5 seconds", 0)

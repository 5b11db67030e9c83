"""Consul: services register themselves with a GRPC health check; the router follows blocking queries.

Registration (every service): `disagg-<role>` with address, gRPC port, tags (model, role) and meta
(layout fingerprint, block size, metrics port), one native Consul GRPC check against our
grpc.health.v1 endpoint, and DeregisterCriticalServiceAfter so a crashed process leaves the
catalog by itself; a graceful shutdown deregisters at once.

Discovery (router): /v1/health/service/disagg-<role>?passing with `index`/`wait` blocking
queries; a view is yielded whenever the set of passing endpoints changes.

The agent's address, ACL token and TLS come from Consul's standard variables (CONSUL_HTTP_ADDR,
CONSUL_HTTP_TOKEN, CONSUL_HTTP_SSL, CONSUL_HTTP_SSL_VERIFY, read by py-consul; CONSUL_CACERT,
CONSUL_CLIENT_CERT, CONSUL_CLIENT_KEY, read here) or from flags.
py-consul's client is synchronous; its calls run in a thread, so blocking queries never block
the event loop. A blocking query runs in a daemon thread of its own, not in asyncio's executor: a router that
stops while one still waits (up to `wait`) exits at once, where an executor thread would hold its exit that long.
(py-consul's aiohttp client would be cancellable, but it builds its connector with arguments aiohttp deprecates.)
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Mapping, TypeVar

import consul

from common.discovery.base import Discovery, Role

log = logging.getLogger(__name__)

T = TypeVar("T")
SERVICE_PREFIX = "disagg-"
_RETRY_S = (0.2, 5.0)  # first and largest back-off after a failed query


def service_name(role: str) -> str:
    return f"{SERVICE_PREFIX}{role}"


@dataclass(frozen=True)
class ConsulSettings:
    """Where the Consul agent is. None fields fall back to py-consul's CONSUL_HTTP_* handling."""

    address: str | None = None  # host:port or scheme://host:port
    token: str | None = None
    wait: str = "5s"  # how long one blocking query may hang
    check_interval: str = "2s"
    check_timeout: str = "2s"
    deregister_after: str = "30s"

    def client(self) -> consul.Consul:
        kwargs: dict = {}
        if self.address:
            scheme, _, rest = self.address.rpartition("://")
            host, _, port = rest.rpartition(":")
            kwargs.update(host=host, port=int(port), scheme=scheme or None)
        if self.token:
            kwargs["token"] = self.token
        # py-consul reads CONSUL_HTTP_SSL(_VERIFY) itself but not the CA / client certificate variables
        if os.environ.get("CONSUL_CACERT"):
            kwargs["verify"] = os.environ["CONSUL_CACERT"]
        if os.environ.get("CONSUL_CLIENT_CERT") and os.environ.get("CONSUL_CLIENT_KEY"):
            kwargs["cert"] = (os.environ["CONSUL_CLIENT_CERT"], os.environ["CONSUL_CLIENT_KEY"])
        return consul.Consul(**kwargs)


def add_consul_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Consul (env CONSUL_HTTP_ADDR, CONSUL_HTTP_TOKEN, CONSUL_HTTP_SSL*)")
    g.add_argument("--consul", action="store_true", default=None,
                   help="register in (and, on the router, discover workers through) Consul; implied by "
                        "--consul-addr or DISAGG_CONSUL=1")
    g.add_argument("--consul-addr", default=None, help="the Consul agent, host:port (default: CONSUL_HTTP_ADDR)")
    g.add_argument("--consul-token", default=None, help="ACL token (default: CONSUL_HTTP_TOKEN)")
    g.add_argument("--consul-deregister-after", default="30s",
                   help="Consul removes a service whose check stays critical this long")
    g.add_argument("--consul-check-interval", default="2s",
                   help="how often the agent runs this service's GRPC health check")
    g.add_argument("--consul-check-timeout", default=None,
                   help="how long one check may take before it counts as failed (default: the interval)")


def consul_from_args(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> ConsulSettings | None:
    """Settings when Consul is on (flag, address flag or DISAGG_CONSUL=1), else None (static discovery)."""
    wanted = args.consul or args.consul_addr or env.get("DISAGG_CONSUL", "").lower() in ("1", "true", "yes")
    if not wanted:
        return None
    return ConsulSettings(address=args.consul_addr, token=args.consul_token,
                          deregister_after=args.consul_deregister_after, check_interval=args.consul_check_interval,
                          check_timeout=args.consul_check_timeout or args.consul_check_interval)


@dataclass
class ServiceRegistration:
    """One process's entry in Consul; `register` on start (after binding), `deregister` on shutdown."""

    settings: ConsulSettings
    role: str
    address: str  # host other processes (and the agent's check) reach us on
    port: int
    tags: list[str] = field(default_factory=list)
    meta: dict[str, str] = field(default_factory=dict)
    grpc_use_tls: bool = False

    @property
    def service_id(self) -> str:
        return f"{service_name(self.role)}-{self.address}-{self.port}"

    def check(self) -> dict:
        return consul.Check.grpc(f"{self.address}:{self.port}", self.settings.check_interval,
                                 use_tls=self.grpc_use_tls or None, timeout=self.settings.check_timeout,
                                 deregister=self.settings.deregister_after)

    async def register(self) -> None:
        client = self.settings.client()
        await asyncio.to_thread(client.agent.service.register, service_name(self.role), service_id=self.service_id,
                                address=self.address, port=self.port, tags=self.tags, meta=self.meta,
                                check=self.check())
        log.info("registered %s in Consul as %s", service_name(self.role), self.service_id)

    async def deregister(self) -> None:
        try:
            await asyncio.to_thread(self.settings.client().agent.service.deregister, self.service_id)
        except Exception as exc:  # the agent may be gone too; its DeregisterCriticalServiceAfter cleans up
            log.warning("could not deregister %s from Consul: %s", self.service_id, exc)


def endpoints_of(nodes: list[dict]) -> list[str]:
    """host:port of each health entry; the service address wins over the node's, as Consul's DNS does."""
    found = []
    for node in nodes:
        service = node["Service"]
        host = service.get("Address") or node["Node"]["Address"]
        found.append(f"{host}:{service['Port']}")
    return sorted(set(found))


class ConsulDiscovery(Discovery):
    def __init__(self, settings: ConsulSettings):
        self._settings = settings
        self._client = settings.client()

    async def endpoints(self, role: Role) -> list[str]:
        _, nodes = await asyncio.to_thread(self._client.health.service, service_name(role.value), passing=True)
        return endpoints_of(nodes)

    async def watch(self, role: Role) -> AsyncIterator[list[str]]:
        index, last, delay = None, None, _RETRY_S[0]
        while True:
            try:
                index, nodes = await in_daemon_thread(lambda: self._client.health.service(
                    service_name(role.value), passing=True, index=index, wait=self._settings.wait))
            except Exception as exc:  # agent restarting or unreachable: keep the last view, retry
                log.warning("Consul query for %s failed (%s); retrying in %.1fs", service_name(role.value), exc, delay)
                index = None
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_S[1])
                continue
            delay = _RETRY_S[0]
            current = endpoints_of(nodes)
            if current != last:
                last = current
                yield current


async def in_daemon_thread(call: Callable[[], T]) -> T:
    """`call()` in a daemon thread; cancelling the await leaves the thread to finish alone (its result dropped)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return  # cancelled before it started: no query
        try:
            future.set_result(call())
        except BaseException as exc:  # handed to the awaiting coroutine
            future.set_exception(exc)

    threading.Thread(target=run, name="consul-blocking-query", daemon=True).start()
    return await asyncio.wrap_future(future)  # which drops the outcome if the loop has closed meanwhile

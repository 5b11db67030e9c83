"""Hosts apart on one machine: Linux network namespaces on a private subnet, joined by one bridge.

    with hosts_apart(3) as net:                 # RuntimeError(netns_unavailable_reason()) where not permitted
        net.hosts[0].address                    # 10.231.N.11, the first "host"
        net.hosts[0].spawn("prefill", "--model", model)   # python -m services.prefill bound on that address
        net.root_address                        # this process's own address on the subnet (it reaches every host)

The bridge lives in a namespace of its own (the switch): bridged frames then meet that namespace's empty
netfilter, not the root's (whose FORWARD policy may be DROP, as Docker sets it). Each host gets one veth into the
switch, and so does the root namespace, so the caller can talk to every host without routing through one. Names
carry a per-run tag; deleting the namespaces (always, in `finally`) removes the bridge and every veth with them.
Every process spawned in a host is stopped by whoever spawned it, before the namespaces go.
"""
from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Mapping

from benchmarks.processes import REPO_ROOT, ServiceProcess

SUBNET_PREFIX = "10.231"


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(("-n", netns) if netns else ()), *args]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")


def netns_unavailable_reason() -> str | None:
    """Why this process cannot build namespaces (not root, no CAP_NET_ADMIN, no `ip`), or None."""
    name = f"disagg-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    except RuntimeError as exc:
        return f"`ip netns add` is not permitted here (needs root or CAP_NET_ADMIN): {exc}"
    _ip("netns", "del", name)
    return None


@dataclass(frozen=True)
class Host:
    netns: str
    address: str
    link: str  # its veth, inside its namespace

    def command(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, *argv: str, env: Mapping[str, str] | None = None, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(*argv), cwd=REPO_ROOT, env={**os.environ, **(env or {})}, **kwargs)

    def spawn(self, role: str, *args: str, env: Mapping[str, str] | None = None) -> ServiceProcess:
        """`python -m services.<role>` in this host, bound on its address (call wait_ready, and always stop)."""
        return ServiceProcess.spawn(role, "--host", self.address, *args, env=env, prefix=tuple(self.command()))

    def shape(self, rate: str) -> None:
        """Limit what this host sends to `rate` (tc's units: 2gbit), a token bucket on its veth."""
        subprocess.run(self.command("tc", "qdisc", "replace", "dev", self.link, "root", "tbf", "rate", rate,
                                    "burst", "4mb", "latency", "50ms"), check=True, capture_output=True)


@dataclass(frozen=True)
class Network:
    hosts: list[Host]
    root_address: str
    switch: str


def _free_subnet() -> int:
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    for third in [(os.getpid() + i) % 200 + 20 for i in range(200)]:
        if f"{SUBNET_PREFIX}.{third}." not in routes:
            return third
    raise RuntimeError(f"no free {SUBNET_PREFIX}.x.0/24 subnet")


@contextmanager
def hosts_apart(count: int) -> Iterator[Network]:
    """`count` namespaces, each a "host" with one address, and the root namespace, on one bridged /24."""
    reason = netns_unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    tag = secrets.token_hex(3)
    third = _free_subnet()
    switch = f"disagg-sw-{tag}"
    names = [f"disagg-h{i}-{tag}" for i in range(count)]
    created: list[str] = []
    try:
        for name in (switch, *names):
            _ip("netns", "add", name)
            created.append(name)
            _ip("link", "set", "lo", "up", netns=name)
        _ip("link", "add", "br0", "type", "bridge", netns=switch)
        _ip("link", "set", "br0", "up", netns=switch)
        root_link = f"dr{tag}"
        _ip("link", "add", root_link, "type", "veth", "peer", "name", f"dr{tag}s", "netns", switch)
        _ip("addr", "add", f"{SUBNET_PREFIX}.{third}.1/24", "dev", root_link)
        _ip("link", "set", root_link, "up")
        _ip("link", "set", f"dr{tag}s", "master", "br0", "up", netns=switch)
        hosts = []
        for i, name in enumerate(names):
            link, address = f"eth{i}", f"{SUBNET_PREFIX}.{third}.{11 + i}"
            _ip("link", "add", link, "netns", name, "type", "veth", "peer", "name", f"h{i}", "netns", switch)
            _ip("addr", "add", f"{address}/24", "dev", link, netns=name)
            _ip("link", "set", link, "up", netns=name)
            _ip("link", "set", f"h{i}", "master", "br0", "up", netns=switch)
            hosts.append(Host(name, address, link))
        yield Network(hosts, f"{SUBNET_PREFIX}.{third}.1", switch)
    finally:
        subprocess.run(["ip", "link", "del", f"dr{tag}"], capture_output=True)
        for name in reversed(created):  # the veths and the bridge go with their namespaces
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

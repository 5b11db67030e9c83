"""`disagg up`'s port checks, made before any process starts: each port judged as its real listener will judge it.

The test bind is the listeners' own (services.kit.ports.bind_problem, SO_REUSEADDR as gRPC, aiohttp and Prometheus'
HTTP server bind): a TIME_WAIT connection the previous `disagg up` left on the port counts as free (the listener will
bind), a listening socket as in use.
"""
from __future__ import annotations

from typing import Mapping

from services.kit.ports import bind_problem


def check_port_free(host: str, port: int, flag: str = "--router-port") -> str | None:
    """None if host:port can be bound now, else a one-line reason naming the flag."""
    problem = bind_problem(host, port) if port else None
    if problem:
        hint = "0 picks a free one" if flag == "--router-port" else "0 turns it off"
        return f"{host}:{port} {problem}; choose another port with {flag} ({hint})"
    return None


def metrics_ports(names: list[str], base: int) -> dict[str, int]:
    """Each child's --metrics-port: base, base+1, ... in `names` order; 0 (a free one) for base 0, -1 (off) for -1."""
    return {name: (0 if not base else -1 if base < 0 else base + i) for i, name in enumerate(names)}


def check_metrics_ports(names: list[str], base: int, host: str, reserved: Mapping[str, int]) -> str | None:
    """With --metrics-port-base: None if every port of its range is valid, free and apart from the routers' (`reserved`:
    each port by the flag that sets it), else one line."""
    if base <= 0:
        return None if base >= -1 else f"--metrics-port-base must be -1 or 0..{65535 - len(names)}, got {base}"
    if base > 65535 - len(names):
        return f"--metrics-port-base must be -1 or 0..{65535 - len(names)}, got {base}"
    ports = metrics_ports(names, base)
    span = f"--metrics-port-base {base} gives ports {min(ports.values())}-{max(ports.values())}"
    for flag, port in reserved.items():
        if port and port in ports.values():
            return f"{span} ({len(ports)} services), which include {flag} {port}; choose another base"
    for name, port in ports.items():
        problem = bind_problem(host, port)
        if problem:
            return f"{host}:{port} ({name}'s metrics port) {problem}; choose another --metrics-port-base " \
                   "(or leave it out: free ports)"
    return None

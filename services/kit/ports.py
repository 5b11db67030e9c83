"""A port a server cannot bind, said in one line that names it: for every listener a process opens (gRPC, the
router's HTTP front door, Prometheus /metrics).

No listener here shares its port: gRPC's SO_REUSEPORT, on by default, is turned off (services.kit.serving), and
aiohttp and Prometheus' HTTP server never set it. A process started on a port another one holds therefore fails to
bind instead of splitting the port's connections with it.
"""
from __future__ import annotations

import errno
import socket

from common.errors import InvalidConfig

IN_USE = "is already in use (another process holds it)"
GRPC_PORT_ENV = "DISAGG_GRPC_PORT"  # every server's --port; a container's healthcheck dials it
ADVERTISE_HOST_ENV = "DISAGG_ADVERTISE_HOST"  # every server's --advertise-host


class PortTaken(InvalidConfig):
    """host:port could not be bound; the message names it, why, and the flag that chooses another."""

    def __init__(self, host: str, port: int, problem: str, flag: str):
        super().__init__(f"{host}:{port} {problem}; choose another {flag}")
        self.host, self.port = host, port


def bind_problem(host: str, port: int) -> str | None:
    """Why host:port cannot be bound now, judged as our listeners bind (SO_REUSEADDR: a TIME_WAIT connection left on
    the port does not count, a listening socket does); None when it can."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return IN_USE if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror or exc})"
    return None


def port_taken(host: str, port: int, flag: str, failure: BaseException) -> PortTaken:
    """The error for a listener's failed bind of host:port (`failure`: what the server raised, which often says
    only that it failed): what a test bind finds, else the failure itself."""
    problem = bind_problem(host, port)
    if problem is None:  # the holder went away meanwhile, or the server failed for another reason
        problem = f"could not be bound ({getattr(failure, 'strerror', None) or failure})"
    return PortTaken(host, port, problem, flag)


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The host other processes reach a server bound on `host` at: --advertise-host, else `host`, or this machine's
    hostname where `host` binds every address."""
    return advertise_host or (socket.gethostname() if host in ("0.0.0.0", "::", "") else host)

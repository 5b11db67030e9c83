"""What every disagg server shares: health, reflection, message caps, error mapping, graceful shutdown."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import errors, tls
from common.telemetry import tracing
from services.kit.ports import PortTaken, bind_problem, port_taken

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# The one place library errors become gRPC status codes.
_STATUS_OF: list[tuple[type[Exception], grpc.StatusCode]] = [
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.InvalidConfig, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.LayoutMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.HandoffMismatch, grpc.StatusCode.INTERNAL),
]


def status_of(exc: BaseException) -> grpc.StatusCode:
    for cls, code in _STATUS_OF:
        if isinstance(exc, cls):
            return code
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code()
    return grpc.StatusCode.INTERNAL


def message_of(exc: BaseException) -> str:
    return exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)


def status_details(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status `exc` maps to and its details; an INTERNAL one (a bug, not a bad request) is logged with its
    traceback."""
    code = status_of(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("internal error", exc_info=exc)
    return code, message_of(exc) or type(exc).__name__


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with the status that `exc` maps to (never returns)."""
    await context.abort(*status_details(exc))


# A unary answer ready with less than this left of its caller's deadline is not sent. The caller's timer started
# before the request travelled here, so it fires first (by a round trip, more under load); grpc does not tell a
# handler that its returned answer went unread, and what that answer names (a KV session, embeddings) would be
# stranded on this worker until its TTL. Failing here lets the handler free it.
DELIVERY_MARGIN_S = 0.02


def check_deliverable(context: grpc.aio.ServicerContext, what: str) -> None:
    """DeadlineExceeded when the caller's deadline leaves no time to deliver the answer `what` names."""
    remaining = context.time_remaining()
    if remaining is not None and remaining < DELIVERY_MARGIN_S:
        raise errors.DeadlineExceeded(f"the deadline passed as {what} was ready ({remaining * 1000:.1f} ms left, "
                                      f"under the {DELIVERY_MARGIN_S * 1000:.0f} ms an answer needs to travel); "
                                      "what it stored is freed")


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class HealthServicer(health.aio.HealthServicer):
    """grpc's, plus `end_watches`: a Watch stream (the router follows every worker's) never ends by itself, and
    would hold the server's shutdown for its whole grace period."""

    def __init__(self) -> None:
        super().__init__()
        self._ended = asyncio.Event()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        watching = asyncio.ensure_future(super().Watch(request, context))
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait({watching, ended}, return_when=asyncio.FIRST_COMPLETED)
            if watching.done():
                watching.result()  # its error, if it failed
        finally:
            watching.cancel()
            ended.cancel()

    def end_watches(self) -> None:
        self._ended.set()


@dataclass
class Server:
    """A started grpc.aio server with its health servicer; `serving(...)` flips health per service."""

    server: grpc.aio.Server
    health: HealthServicer
    service_names: list[str]
    port: int

    async def set_serving(self, serving: bool) -> None:
        status = _SERVING if serving else _NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float, drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """Graceful shutdown: NOT_SERVING, let `drain` finish or end the work, end the health watches, then stop
        (RPCs still running after `grace_s` are cancelled)."""
        await self.set_serving(False)
        if drain is not None:
            await drain()
        self.health.end_watches()
        await self.server.stop(grace_s)


async def start_server(
    add_servicers: Callable[[grpc.aio.Server], None],
    service_full_names: Iterable[str],
    host: str,
    port: int,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    reuse_port: bool = False,
) -> Server:
    """Start a server with health (NOT_SERVING until `set_serving(True)`) and reflection; TLS when the
    process is configured for it (common.tls). PortTaken when host:port cannot be bound (every
    server's gRPC port is its --port). `reuse_port`: the port is shared with servers started the same way."""
    interceptors = [*tracing.server_interceptors(), *interceptors]  # tracing first: it opens the RPC's span
    # No SO_REUSEPORT (gRPC's default) unless asked: a second server on a port another process holds would bind it
    # too, and the kernel would spread connections over both.
    options = [*channel_options(max_message_bytes), ("grpc.so_reuseport", int(reuse_port))]
    server = grpc.aio.server(options=options, interceptors=interceptors)
    add_servicers(server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_full_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    settings = tls.current()
    address = f"{host}:{port}"
    problem = bind_problem(host, port) if port and not reuse_port else None  # before gRPC, which would log it too
    if problem:
        raise PortTaken(host, port, problem, "--port")
    try:
        bound = (server.add_secure_port(address, settings.server_credentials()) if settings.serves_tls
                 else server.add_insecure_port(address))
        if bound == 0:
            raise RuntimeError(f"gRPC could not bind {address}")
    except RuntimeError as exc:  # gRPC says only that the bind failed
        raise port_taken(host, port, "--port", exc) from None
    await server.start()
    result = Server(server, health_servicer, names, bound)
    await result.set_serving(False)
    return result


def setup_logging(process_name: str, level: str) -> None:
    """Warnings from everything; `level` for our own loggers only (--log-level debug should not turn
    on grpc's and asyncio's)."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {process_name} %(levelname)s %(name)s: %(message)s")
    for ours in ("common", "services"):
        logging.getLogger(ours).setLevel(level.upper())


async def wait_for_signal() -> None:
    """Until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

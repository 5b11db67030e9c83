"""A real grpc.aio server on a free loopback port, for the unit tests that put a servicer (or a fake one) behind
gRPC in their own process."""
from __future__ import annotations

import contextlib
from typing import AsyncIterator, Callable

import grpc


@contextlib.asynccontextmanager
async def loopback_server(register: Callable[[grpc.aio.Server], object],
                          **server_options) -> AsyncIterator[tuple[grpc.aio.Server, str]]:
    """(server, "127.0.0.1:PORT") with what `register(server)` adds, started; stopped (no grace) on exit.
    `server_options` go to grpc.aio.server (interceptors, ...)."""
    server = grpc.aio.server(**server_options)
    register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)

"""No server shares its port: a gRPC server started where another process's listener is (even one with gRPC's
default SO_REUSEPORT) is refused with PortTaken naming the port; a port left in TIME_WAIT is free."""
from __future__ import annotations

import asyncio
import socket
from concurrent import futures

import grpc
import pytest

from services.kit.ports import IN_USE, PortTaken, bind_problem
from services.kit.serving import start_server


def _listener_with_grpc_defaults() -> tuple[grpc.Server, int]:
    """A gRPC server as grpc makes it by default, SO_REUSEPORT on: our servers once bound its port beside it."""
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_a_server_on_a_port_another_grpc_server_holds_is_refused_naming_it():
    holder, port = _listener_with_grpc_defaults()
    try:
        with pytest.raises(PortTaken) as refused:
            asyncio.run(start_server(lambda s: None, [], "127.0.0.1", port))
        assert str(refused.value) == f"127.0.0.1:{port} {IN_USE}; choose another --port"
    finally:
        holder.stop(0)



def test_no_listener_binds_beside_our_server_even_with_so_reuseport():
    async def bind_beside() -> None:
        server = await start_server(lambda s: None, [], "127.0.0.1", 0)
        try:
            with socket.socket() as other:  # as a second gRPC server (its default) would bind
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                with pytest.raises(OSError, match="in use"):
                    other.bind(("127.0.0.1", server.port))
        finally:
            await server.server.stop(0)
    asyncio.run(bind_beside())

def test_a_port_holding_only_a_time_wait_connection_is_free():
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        assert bind_problem("127.0.0.1", port) == IN_USE
        accepted.close()  # the server's side closes first: its end of the connection waits in TIME_WAIT
        client.close()
    assert bind_problem("127.0.0.1", port) is None

    async def serve_and_stop() -> int:
        server = await start_server(lambda s: None, [], "127.0.0.1", port)
        await server.server.stop(0)
        return server.port
    assert asyncio.run(serve_and_stop()) == port

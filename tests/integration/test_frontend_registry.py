"""A front door is its own module plus one registry line: this test registers one from here, touching no router
file — a gRPC service on the router's port and a listener of its own — and a router process serves it beside the
built-in doors, handing it the core."""
from __future__ import annotations

import asyncio
import os
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router import frontends
from tests.integration.processes import ServiceProcess, free_port

ECHO = "test.Echo"
LISTENER_PORT_ENV = "TEST_FRONT_DOOR_PORT"


def _add_echo(server: grpc.aio.Server, core) -> None:
    async def say(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request + f" (core ready: {core.ready()})".encode()

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(ECHO, {
        "Say": grpc.unary_unary_rpc_method_handler(say)})])


class _Listener:
    def __init__(self, server: asyncio.Server):
        self._server = server

    def banner(self, host: str) -> str:
        return f"test door on {host}"

    async def stop(self) -> None:
        self._server.close()
        await self._server.wait_closed()


async def _start_listener(core, config, metrics) -> _Listener | None:
    port = int(os.environ.get(LISTENER_PORT_ENV, "0"))
    if not port:
        return None

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"served by {config.host}\n".encode())
        await writer.drain()
        writer.close()

    return _Listener(await asyncio.start_server(greet, config.host, port))


frontends.register("test_echo", frontends.FrontDoor(grpc_services=(ECHO,), add_to_server=_add_echo,
                                                     start=_start_listener))


def test_the_built_in_doors_and_a_registered_one_are_all_served():
    assert frontends.names()[:3] == ("generation", "kserve", "openai") and "test_echo" in frontends.names()
    services = [name for door in frontends.doors() for name in door.grpc_services]
    assert services == ["disagg.v1.Generation", "inference.GRPCInferenceService", ECHO]


def _read_line(port: int, timeout_s: float = 60.0) -> bytes:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                return sock.makefile("rb").readline()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.slow
def test_a_router_process_serves_a_front_door_from_a_module_named_in_the_environment():
    grpc_port, listener_port = free_port(), free_port()
    env = {frontends.MODULES_ENV: "tests.integration.test_frontend_registry", LISTENER_PORT_ENV: str(listener_port)}
    router = ServiceProcess.spawn("router", "--model", "default", "--host", "127.0.0.1", "--port", str(grpc_port),
                                  env=env)  # no workers: it serves its doors, never SERVING
    try:
        assert _read_line(listener_port) == b"served by 127.0.0.1\n", router.log()
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            say = channel.unary_unary(f"/{ECHO}/Say")
            assert say(b"hello", timeout=30) == b"hello (core ready: False)"
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=ECHO), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING  # known to health, not NOT_FOUND
    finally:
        router.stop()

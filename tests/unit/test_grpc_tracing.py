"""common.telemetry.grpc_tracing: the instrumentation's interceptors serve every streaming handler (an async
generator is closed in the RPC's own task), carry the trace from client to server, and end a streaming call's
client span when the caller cancels early or the call fails while nobody reads it, with the call's status."""
from __future__ import annotations

import asyncio
import contextlib

import grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.telemetry import grpc_tracing
from tests.loopback_grpc import loopback_server

METHOD = "/test.Counter/Count"


async def _count(request: bytes, context: grpc.aio.ServicerContext) -> None:
    """Write-style (a coroutine that calls context.write), like Generate and Decode."""
    for i in range(int(request)):
        await context.write(str(i).encode())
        await asyncio.sleep(0.01)


class _Server:
    """A traced server with one streaming method, `handler`, and a traced channel to it."""

    def __init__(self, handler, kind=grpc.unary_stream_rpc_method_handler) -> None:
        self.handler, self.kind = handler, kind
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    async def __aenter__(self) -> grpc.aio.Channel:
        counter = grpc.method_handlers_generic_handler("test.Counter", {"Count": self.kind(self.handler)})
        self.stack = contextlib.AsyncExitStack()
        _, address = await self.stack.enter_async_context(loopback_server(
            lambda server: server.add_generic_rpc_handlers([counter]),
            interceptors=grpc_tracing.server_interceptors(self.provider)))
        channel = grpc.aio.insecure_channel(address, interceptors=grpc_tracing.client_interceptors(self.provider))
        self.stack.push_async_callback(channel.close)  # closed before the server stops
        return channel

    async def __aexit__(self, *exc_info) -> None:
        await self.stack.aclose()


async def _run(read_all: bool) -> tuple[list[bytes], InMemorySpanExporter]:
    server = _Server(_count)
    async with server as channel:
        call = channel.unary_stream(METHOD)(b"50")
        received = []
        async for message in call:
            received.append(message)
            if not read_all:
                call.cancel()
                break
        for _ in range(100):  # the server span ends once the server sees the cancel
            if len(server.exporter.get_finished_spans()) == 2:
                break
            await asyncio.sleep(0.02)
    return received, server.exporter


def _by_kind(exporter: InMemorySpanExporter):
    spans = {span.kind.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"CLIENT", "SERVER"}, exporter.get_finished_spans()
    return spans["CLIENT"], spans["SERVER"]


def test_write_style_stream_is_served_and_traced_from_client_to_server():
    received, exporter = asyncio.run(_run(read_all=True))
    assert received == [str(i).encode() for i in range(50)]
    client, server = _by_kind(exporter)
    assert client.name == server.name == METHOD
    assert server.parent.span_id == client.context.span_id
    assert server.context.trace_id == client.context.trace_id


def test_a_stream_cancelled_early_still_ends_its_client_span():
    received, exporter = asyncio.run(_run(read_all=False))
    assert received == [b"0"]
    client, server = _by_kind(exporter)
    assert server.parent.span_id == client.context.span_id


def test_a_generator_handler_cancelled_between_responses_is_closed_in_its_own_task(caplog):
    """grpc leaves an async generator handler unclosed when the RPC is cancelled while a response is being
    sent; closed later by its finalizer in another task, the traced handler failed to detach its context."""
    tasks = {}

    async def flood(request: bytes, context):  # responses bigger than the flow-control window: sends block
        tasks["ran"] = asyncio.current_task()
        try:
            while True:
                yield b"x" * 200_000
        finally:
            tasks["closed"] = asyncio.current_task()

    async def run() -> None:
        async with _Server(flood) as channel:
            call = channel.unary_stream(METHOD)(b"")
            await call.read()
            await asyncio.sleep(0.2)  # the server is stuck sending the next one
            call.cancel()
            for _ in range(100):
                if "closed" in tasks:
                    break
                await asyncio.sleep(0.02)

    asyncio.run(run())
    assert tasks["closed"] is tasks["ran"]
    # (grpc itself may log an ExecuteBatchError for the send the cancel broke: its race, not the tracing's)
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")], caplog.text


def test_a_stream_that_fails_while_its_caller_is_not_reading_ends_its_span_with_the_error(caplog):
    """The span ends when the call does, with the call's status; the reader that meets the error afterwards
    records nothing on the ended span ("Setting attribute on ended span")."""
    async def one_then_wait(request: bytes, context):
        await context.write(b"0")
        await asyncio.sleep(5)

    async def run(server: _Server) -> grpc.StatusCode:
        async with server as channel:
            call = channel.unary_stream(METHOD)(b"", timeout=0.3)
            await call.read()
            await asyncio.sleep(0.6)  # the deadline passes while nobody reads
            try:
                await call.read()
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    server = _Server(one_then_wait)
    assert asyncio.run(run(server)) is grpc.StatusCode.DEADLINE_EXCEEDED
    client = next(s for s in server.exporter.get_finished_spans() if s.kind.name == "CLIENT")
    assert client.status.status_code.name == "ERROR" and "DEADLINE_EXCEEDED" in client.status.description
    assert client.attributes["rpc.grpc.status_code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "ended span" not in caplog.text, caplog.text


def test_a_unary_call_cancelled_while_it_runs_is_cancelled_on_the_wire_and_its_span_ends():
    """The library waited for the status inside the interceptor: cancelling the call cancelled that wait only."""
    server_saw = asyncio.Event()

    async def slow(request: bytes, context) -> bytes:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            server_saw.set()
            raise
        return b"late"

    async def run(server: _Server) -> None:
        async with server as channel:
            call = channel.unary_unary(METHOD)(b"")
            await asyncio.sleep(0.3)
            assert call.cancel()
            await asyncio.wait_for(server_saw.wait(), 5)

    server = _Server(slow, grpc.unary_unary_rpc_method_handler)
    asyncio.run(run(server))
    assert [s.kind.name for s in server.exporter.get_finished_spans()].count("CLIENT") == 1

"""common.telemetry.grpc_tracing: the instrumentation's interceptors serve write-style streaming handlers, carry
the trace from client to server, and end a streaming call's client span when the caller cancels early."""
from __future__ import annotations

import asyncio

import grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.telemetry import grpc_tracing

METHOD = "/test.Counter/Count"


async def _count(request: bytes, context: grpc.aio.ServicerContext) -> None:
    """Write-style (a coroutine that calls context.write), like Generate and Decode."""
    for i in range(int(request)):
        await context.write(str(i).encode())
        await asyncio.sleep(0.01)


async def _run(read_all: bool) -> tuple[list[bytes], InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = grpc.aio.server(interceptors=grpc_tracing.server_interceptors(provider))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Counter", {
        "Count": grpc.unary_stream_rpc_method_handler(_count)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             interceptors=grpc_tracing.client_interceptors(provider)) as channel:
            call = channel.unary_stream(METHOD)(b"50")
            received = []
            async for message in call:
                received.append(message)
                if not read_all:
                    call.cancel()
                    break
            for _ in range(100):  # the server span ends once the server sees the cancel
                if len(exporter.get_finished_spans()) == 2:
                    break
                await asyncio.sleep(0.02)
    finally:
        await server.stop(None)
    return received, exporter


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

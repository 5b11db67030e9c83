"""The router's Decode stream under tracing (grpc client interceptors on): a cancelled request stays cancelled,
and a stream the worker ended leaves no writer task behind ("Task was destroyed but it is pending!" and
"aclose(): asynchronous generator is already running" in a run's log)."""
from __future__ import annotations

import asyncio

import grpc
from opentelemetry.sdk.trace import TracerProvider

from common.telemetry import grpc_tracing
from services.router.decode_stream import _end_call, _write
from tests.loopback_grpc import loopback_server

METHOD = "/test.Echo/Echo"


async def _echo_once(requests, context) -> None:
    async for request in requests:
        await context.write(request)
        return  # the worker ends the stream (a Finished), the client never half-closed it


async def _with_traced_call(body):
    echo = grpc.method_handlers_generic_handler("test.Echo",
                                                {"Echo": grpc.stream_stream_rpc_method_handler(_echo_once)})
    async with loopback_server(lambda server: server.add_generic_rpc_handlers([echo])) as (_, address):
        interceptors = grpc_tracing.client_interceptors(TracerProvider())
        async with grpc.aio.insecure_channel(address, interceptors=interceptors) as channel:
            return await body(channel.stream_stream(METHOD))


def _writers() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if "_consume_request_iterator" in repr(t.get_coro())]


def test_a_stream_the_worker_ended_leaves_no_writer_task_pending():
    async def body(method) -> list[asyncio.Task]:
        call = method()
        await _write(call, b"start")
        assert await call.read() == b"start"
        await call.wait_for_connection()
        await call.code()  # the worker has ended the stream
        await _end_call(call)
        await asyncio.sleep(0.1)
        return _writers()

    assert asyncio.run(_with_traced_call(body)) == []


def test_a_request_cancelled_while_its_call_is_set_up_ends_cancelled():
    async def body(method) -> BaseException | None:
        async def start() -> None:
            call = method()
            try:
                await _write(call, b"start")  # the interceptors have not run yet
            finally:
                await _end_call(call)

        task = asyncio.ensure_future(start())
        await asyncio.sleep(0)
        task.cancel()
        results = await asyncio.gather(task, return_exceptions=True)
        return results[0]

    assert isinstance(asyncio.run(_with_traced_call(body)), asyncio.CancelledError)

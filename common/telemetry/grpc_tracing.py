"""opentelemetry-instrumentation-grpc's aio interceptors, fitted to how disagg streams.

Four gaps of the library, closed here rather than worked around at every call site:
- its server interceptor wraps a response-streaming handler in an async generator that opens the span and
  attaches the trace context. grpc leaves that generator unclosed when the RPC is cancelled between two
  responses, and its finalizer closes it later in another task, where detaching the context fails ("Failed
  to detach context"). Every streaming handler is served here as one coroutine instead: an async generator
  handler (Decode, Pull, SubscribeKvEvents) is written out with `context.write` and closed in the RPC's own
  task; a coroutine handler (Generate) is served unchanged;
- its client interceptors end a streaming call's span only when the caller reads the stream to its
  end; ours stop reading at the Finished message and cancel, so the span also ends when the call does,
  with the call's status;
- ... and a reader that meets the call's error after that records it only on a span still open;
- a unary call cancelled while it runs was cancelled only inside the interceptor: the RPC ran on.
Health and reflection (`grpc.*` services) are not traced: Consul checks every service every few seconds.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import _aio_client, _aio_server
from opentelemetry.instrumentation.grpc.filters import negate, service_prefix
from opentelemetry.semconv._incubating.attributes.rpc_attributes import RPC_GRPC_STATUS_CODE
from opentelemetry.trace.status import Status, StatusCode

_NOT_GRPC_INTERNALS = negate(service_prefix("grpc."))
_ending: set[asyncio.Task] = set()


def _written(behavior):
    """An async generator handler as a coroutine handler: each response written, the generator closed here."""
    async def write_all(request_or_iterator, context):
        async with contextlib.aclosing(behavior(request_or_iterator, context)) as responses:
            async for response in responses:
                await context.write(response)
    return write_all


class _ServerInterceptor(_aio_server.OpenTelemetryAioServerInterceptor):
    def _intercept_aio_server_stream(self, behavior, handler_call_details):
        if not inspect.iscoroutinefunction(behavior):
            behavior = _written(behavior)
        return self._intercept_aio_server_unary(behavior, handler_call_details)


def _end(span: trace.Span) -> None:
    if span.is_recording():
        span.end()


def _end_with_call(span: trace.Span, call) -> None:
    """Once the call is done: its status on the span, then the span ended (unless its reader ended it first)."""
    async def end() -> None:
        code = await call.code()  # the call is done: no wait
        if span.is_recording():
            span.set_attribute(RPC_GRPC_STATUS_CODE, code.value[0])
            if code is not grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, f"{code.name}: {await call.details()}"))
            span.end()
    def done(_) -> None:
        task = asyncio.ensure_future(end())
        _ending.add(task)  # held until it has run
        task.add_done_callback(_ending.discard)
    call.add_done_callback(done)


class _StreamResponseEnds:
    """Mixin: a response stream's client span ends when the call is done, read to the end or not."""

    async def _wrap_stream_response(self, span, call):
        _end_with_call(span, call)
        try:
            async for response in call:
                yield response
        except Exception as exc:
            if span.is_recording():  # else the call's end recorded its status already
                self.add_error_details_to_span(span, exc)
            raise
        finally:
            _end(span)


class _UnaryResponseCancels:
    """Mixin: the library waits for a unary call's status inside the interceptor, so cancelling the call cancels
    only that wait, leaving the RPC running and its span open; here the RPC is cancelled and the span ended too."""

    async def _wrap_unary_response(self, continuation, span):
        started = []

        async def start():
            started.append(await continuation())
            return started[-1]
        try:
            return await super()._wrap_unary_response(start, span)
        except asyncio.CancelledError:
            for call in started:
                call.cancel()
            _end(span)
            raise


class _UnaryUnary(_UnaryResponseCancels, _aio_client.UnaryUnaryAioClientInterceptor):
    pass


class _StreamUnary(_UnaryResponseCancels, _aio_client.StreamUnaryAioClientInterceptor):
    pass


class _UnaryStream(_StreamResponseEnds, _aio_client.UnaryStreamAioClientInterceptor):
    pass


class _StreamStream(_StreamResponseEnds, _aio_client.StreamStreamAioClientInterceptor):
    pass


def _tracer(provider) -> trace.Tracer:
    return provider.get_tracer("opentelemetry.instrumentation.grpc")


def server_interceptors(provider) -> list[grpc.aio.ServerInterceptor]:
    return [_ServerInterceptor(_tracer(provider), filter_=_NOT_GRPC_INTERNALS)]


def client_interceptors(provider) -> list[grpc.aio.ClientInterceptor]:
    tracer = _tracer(provider)
    return [cls(tracer, filter_=_NOT_GRPC_INTERNALS) for cls in
            (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]

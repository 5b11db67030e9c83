"""opentelemetry-instrumentation-grpc's aio interceptors, fitted to how disagg streams.

Two gaps of the library, closed here rather than worked around at every call site:
- its server interceptor wraps every response-streaming handler as an async generator; ours are
  coroutines that call `context.write` (Generate, Decode), which its unary wrapper serves unchanged;
- its client interceptors end a streaming call's span only when the caller reads the stream to its
  end; ours stop reading at the Finished message and cancel, so the span also ends when the call does.
Health and reflection (`grpc.*` services) are not traced: Consul checks every service every few seconds.
"""
from __future__ import annotations

import inspect

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import _aio_client, _aio_server
from opentelemetry.instrumentation.grpc.filters import negate, service_prefix

_NOT_GRPC_INTERNALS = negate(service_prefix("grpc."))


class _ServerInterceptor(_aio_server.OpenTelemetryAioServerInterceptor):
    def _intercept_aio_server_stream(self, behavior, handler_call_details):
        if inspect.iscoroutinefunction(behavior):
            return self._intercept_aio_server_unary(behavior, handler_call_details)
        return super()._intercept_aio_server_stream(behavior, handler_call_details)


def _end(span: trace.Span) -> None:
    if span.is_recording():
        span.end()


class _StreamResponseEnds:
    """Mixin: a response stream's client span ends when the call is done, read to the end or not."""

    async def _wrap_stream_response(self, span, call):
        call.add_done_callback(lambda _: _end(span))
        try:
            async for response in call:
                yield response
        except Exception as exc:
            self.add_error_details_to_span(span, exc)
            raise
        finally:
            _end(span)


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
            (_aio_client.UnaryUnaryAioClientInterceptor, _UnaryStream,
             _aio_client.StreamUnaryAioClientInterceptor, _StreamStream)]

"""Requests that are not protobuf messages get INVALID_ARGUMENT with protobuf's reason.

grpc.aio parses a unary request before the servicer runs; bytes it cannot parse (garbage, a string field
with bad UTF-8) end the RPC with UNKNOWN and a traceback in the server's log. This interceptor takes the
parsing into the handler, where a failure is the caller's fault and is answered as such. Streamed requests
are parsed as the servicer reads them, where the servicer itself turns a DecodeError into a status.
"""
from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError


class ParseRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, details.method
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext):
                return await inner(await _parse(parse, raw, method, context), context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, None, handler.response_serializer)
        inner = handler.unary_stream
        if inspect.isasyncgenfunction(inner):
            async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext):
                async for response in inner(await _parse(parse, raw, method, context), context):
                    yield response
        else:  # a servicer that writes with context.write and returns None
            async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext):
                return await inner(await _parse(parse, raw, method, context), context)
        return grpc.unary_stream_rpc_method_handler(unary_stream, None, handler.response_serializer)


async def _parse(parse: Callable[[bytes], Any], raw: bytes, method: str, context: grpc.aio.ServicerContext):
    try:
        return parse(raw)
    except DecodeError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the {method} request is not a valid message: {exc}")

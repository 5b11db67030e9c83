"""A gRPC server's RPCs require an API key (services.kit.auth): UNAUTHENTICATED without one or with a wrong one.

grpc.health.v1, reflection and the RPCs a caller names as health (the router's KServe ServerLive, ServerReady and
ModelReady) stay open unless --api-key-protects-health: load balancers, `grpcurl list` and Kubernetes probes carry
no key. A refusal is answered by a handler of the RPC's own kind (unary or streaming), before the request is parsed.
"""
from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Iterable

import grpc

from services.kit.auth import AUTHORIZATION, MISSING, X_API_KEY, ApiKeys, presented_key

log = logging.getLogger(__name__)

OPEN_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                           "grpc.reflection.v1.ServerReflection"})


class RequireApiKey(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys, health_methods: Iterable[str] = ()):
        """`health_methods`: full method names ("/package.Service/Method") open like grpc.health.v1."""
        self._keys = keys
        self._health = frozenset(health_methods)

    def _is_health(self, method: str) -> bool:
        return method.lstrip("/").rpartition("/")[0] in OPEN_SERVICES or method in self._health

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not self._keys.guards(self._is_health(details.method)):
            return handler
        metadata = {key: value for key, value in details.invocation_metadata or () if isinstance(value, str)}
        refusal = self._keys.refusal(presented_key(metadata.get(AUTHORIZATION), metadata.get(X_API_KEY)))
        if refusal is None:
            return handler
        log.info("refused %s: %s", details.method, "no API key" if refusal == MISSING else "a wrong API key")
        return _refusing(handler, refusal)


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.unary_unary is not None:
        make = grpc.unary_unary_rpc_method_handler
    elif handler.unary_stream is not None:
        make = grpc.unary_stream_rpc_method_handler
    elif handler.stream_unary is not None:
        make = grpc.stream_unary_rpc_method_handler
    else:
        make = grpc.stream_stream_rpc_method_handler
    return make(refuse, None, handler.response_serializer)  # no deserializer: the request stays unread bytes


def api_key_interceptors(keys: ApiKeys, health_methods: Iterable[str] = ()) -> list[grpc.aio.ServerInterceptor]:
    """The interceptor when keys are set; none otherwise (no cost on an open server)."""
    return [RequireApiKey(keys, health_methods)] if keys.required else []

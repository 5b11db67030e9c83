"""OpenTelemetry tracing: one trace per request across router → encode → prefill → KV pull → decode.

On when OTEL_EXPORTER_OTLP_ENDPOINT is set (OTLP over gRPC; OTEL_EXPORTER_OTLP_INSECURE and the
other standard OTEL_* variables apply), with OTEL_SERVICE_NAME or `disagg-<role>` as the service
name. opentelemetry-instrumentation-grpc's interceptors carry W3C `traceparent` in gRPC metadata:
the server interceptor continues a caller's trace (a client's own traceparent included), the
client interceptors start child spans for every call to another process; opentelemetry-instrumentation-aiohttp-server
does the server's part for the router's HTTP front door. Our own spans
(tokenize, prefill, kv_pull, decode, first_token) hang under them. Off, every helper is a no-op.
"""
from __future__ import annotations

import logging
import os
from typing import Sequence

import grpc
from opentelemetry import trace

log = logging.getLogger(__name__)

_provider = None  # the process's TracerProvider once set up


def setup_tracing(role: str) -> bool:
    """Install the OTLP exporter if OTEL_EXPORTER_OTLP_ENDPOINT is set; True when tracing is on."""
    global _provider
    if _provider is not None:
        return True
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or f"disagg-{role}"
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name, "disagg.role": role}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing to %s as %s", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"), name)
    return True


def shutdown_tracing() -> None:
    """Flush spans still buffered (call on graceful shutdown)."""
    if _provider is not None:
        _provider.shutdown()


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """Continue the caller's trace in every RPC this process serves (none when tracing is off)."""
    if _provider is None:
        return []
    from common.telemetry import grpc_tracing

    return grpc_tracing.server_interceptors(_provider)


def client_interceptors() -> Sequence[grpc.aio.ClientInterceptor]:
    """A child span and a traceparent on every call this process makes (none when tracing is off)."""
    if _provider is None:
        return []
    from common.telemetry import grpc_tracing

    return grpc_tracing.client_interceptors(_provider)


def instrument_http_server() -> None:
    """For the router's OpenAI front door (aiohttp): every aiohttp Application made afterwards gets a SERVER span
    per request that continues the client's W3C `traceparent` header, so an HTTP request is one trace as a gRPC one
    is. /health is not traced (nor is gRPC health). A no-op when tracing is off or already instrumented."""
    if _provider is None:
        return
    os.environ.setdefault("OTEL_PYTHON_AIOHTTP_SERVER_EXCLUDED_URLS", "/health")
    from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor

    instrumentor = AioHttpServerInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(tracer_provider=_provider)


def tracer() -> trace.Tracer:
    return trace.get_tracer("disagg")

"""A real OTLP/gRPC trace receiver for tests: opentelemetry-proto's TraceService, keeping every span it gets."""
from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int
    attributes: dict
    events: tuple[str, ...]


def _value(any_value):
    return getattr(any_value, any_value.WhichOneof("value")) if any_value.WhichOneof("value") else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """`start()`, export to `endpoint`, read `spans`, `stop()`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def export_env(self) -> dict[str, str]:
        """The environment that makes a disagg process export its spans here."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"}

    def start(self) -> "OtlpReceiver":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context) -> \
            trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=resource.get("service.name", ""), name=span.name, trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(), kind=span.kind,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        events=tuple(e.name for e in span.events)))
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

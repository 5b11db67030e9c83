"""The stand-ins that deploy/compose/offline-up.sh runs where the consul / jaeger / prometheus images cannot be pulled,
here as local processes (the docker test runs them in their image): the Prometheus stand-in applies compose's
prometheus.yml unchanged and scrapes the metrics port that a passing service registers in Consul, and nothing else;
the Jaeger stand-in answers Jaeger's query API with one trace across two services."""
from __future__ import annotations

import json
import shutil
import threading
import urllib.request
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import set_span_in_context
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from tests.integration.compose_stand_ins import jaeger_query, json_server, run_prometheus
from tests.integration.observed import wait_for
from tests.integration.processes import REPO_ROOT, free_port


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


@pytest.fixture
def service_serving_metrics():
    """A gRPC health endpoint (SERVING) and a /metrics endpoint on another port, as a disagg process has."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    registry = CollectorRegistry()
    Gauge("stand_in_probe", "a sample to scrape", registry=registry).set(1)
    metrics, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield grpc_port, metrics.server_address[1]
    finally:
        metrics.shutdown()
        server.stop(None)


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="the prometheus server is not installed "
                                                               "(deploy/install.sh installs the Debian package)")
def test_prometheus_stand_in_scrapes_the_metrics_port_a_passing_service_registers(tmp_path, service_serving_metrics,
                                                                                 consul_double):
    (grpc_port, metrics_port), double = service_serving_metrics, consul_double
    for service_id, port in (("decode-1", grpc_port), ("decode-gone", free_port())):  # the second fails its check
        double.register({"Name": "disagg-decode", "ID": service_id, "Address": "127.0.0.1", "Port": port,
                         "Meta": {"metrics_port": str(metrics_port)},
                         "Check": {"GRPC": f"127.0.0.1:{port}", "Interval": "1s", "Timeout": "1s"}})
    config = tmp_path / "prometheus.yml"
    config.write_text((REPO_ROOT / "deploy/compose/prometheus.yml").read_text().replace("consul:8500", double.address))
    listen, stop = f"127.0.0.1:{free_port()}", threading.Event()
    prometheus = threading.Thread(target=run_prometheus, args=(str(config), stop, listen, free_port(), str(tmp_path)))
    prometheus.start()
    try:
        def scraped() -> list[dict]:
            try:
                targets = _get(f"http://{listen}/api/v1/targets")["data"]["activeTargets"]
            except OSError:
                return []
            return targets if targets and all(t["health"] == "up" for t in targets) else []

        targets = wait_for(scraped, 60, "Prometheus to scrape the registered service")
        assert [(t["labels"]["service"], t["labels"]["instance"], t["scrapeUrl"]) for t in targets] == [
            ("disagg-decode", "decode-1", f"http://127.0.0.1:{metrics_port}/metrics")]
    finally:
        stop.set()
        prometheus.join(30)
    assert not prometheus.is_alive()


def test_jaeger_stand_in_answers_the_query_api_with_one_trace_across_services(receiver):
    query = json_server("127.0.0.1", 0, jaeger_query(receiver))
    try:
        providers = {name: TracerProvider(resource=Resource.create({"service.name": name}))
                     for name in ("disagg-router", "disagg-decode")}
        for provider in providers.values():
            provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint,
                                                                             insecure=True)))
        with providers["disagg-router"].get_tracer("t").start_as_current_span("Generate") as root:
            providers["disagg-decode"].get_tracer("t").start_span("Decode", set_span_in_context(root)).end()
        for provider in providers.values():
            provider.shutdown()
        base = f"http://127.0.0.1:{query.server_address[1]}"
        assert _get(f"{base}/api/services")["data"] == ["disagg-decode", "disagg-router"]
        [trace] = _get(f"{base}/api/traces?service=disagg-decode")["data"]
        services = {span["operationName"]: trace["processes"][span["processID"]]["serviceName"]
                    for span in trace["spans"]}
        assert services == {"Generate": "disagg-router", "Decode": "disagg-decode"}
        decode = next(s for s in trace["spans"] if s["operationName"] == "Decode")
        assert decode["references"] == [{"refType": "CHILD_OF", "traceID": trace["traceID"],
                                         "spanID": format(root.get_span_context().span_id, "016x")}]
    finally:
        query.shutdown()

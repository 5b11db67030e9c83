"""`python -m tests.integration.compose_stand_ins consul|jaeger|prometheus CONFIG`: what runs in the images that
stand in for `hashicorp/consul`, `jaegertracing/all-in-one` and `prom/prometheus` where no registry can be reached
to pull those (deploy/compose/Dockerfile.stand-ins, deploy/compose/stand-ins.yml, deploy/compose/offline-up.sh).

- consul: the Consul double (tests/consul_double.py) on 0.0.0.0:8500.
- jaeger: the OTLP receiver (tests/integration/otlp_receiver.py) on 0.0.0.0:4317, and on 0.0.0.0:16686 the part of
  Jaeger's HTTP query API that tests read: `/api/services`, `/api/traces?service=NAME` (Jaeger's JSON shape).
- prometheus: Debian's Prometheus server, which is built without Consul service discovery, on 0.0.0.0:9090, with
  CONFIG's `consul_sd_configs` turned into `http_sd_configs` against a small adapter here that reads the same
  Consul health endpoint and hands Prometheus the same `__meta_consul_*` labels, so CONFIG's relabelling applies
  unchanged.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import yaml

from tests.consul_double import ConsulDouble
from tests.integration.otlp_receiver import OtlpReceiver

JAEGER_QUERY_PORT = 16686
SD_PORT = 9091  # the adapter, on loopback inside the prometheus stand-in


Answer = Callable[[str, dict[str, list[str]]], object]  # (path, query) -> the JSON body, or None for 404


def json_server(host: str, port: int, answer: Answer) -> ThreadingHTTPServer:
    """A GET-only JSON HTTP server, serving from a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            body = answer(url.path, urllib.parse.parse_qs(url.query))
            data = json.dumps(body).encode()
            self.send_response(404 if body is None else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def jaeger_query(receiver: OtlpReceiver) -> Answer:
    def trace(trace_id: str) -> dict:
        spans = receiver.trace(trace_id)
        processes = {f"p{i}": {"serviceName": name, "tags": []}
                     for i, name in enumerate(sorted({s.service for s in spans}))}
        process_of = {p["serviceName"]: key for key, p in processes.items()}
        return {"traceID": trace_id, "processes": processes, "spans": [
            {"traceID": s.trace_id, "spanID": s.span_id, "operationName": s.name, "processID": process_of[s.service],
             "references": [{"refType": "CHILD_OF", "traceID": s.trace_id, "spanID": s.parent_span_id}]
             if s.parent_span_id else []} for s in spans]}

    def answer(path: str, query: dict[str, list[str]]):
        spans = list(receiver.spans)
        if path == "/api/services":
            return {"data": sorted({s.service for s in spans})}
        if path == "/api/traces" and "service" in query:
            ids = sorted({s.trace_id for s in spans if s.service == query["service"][0]})
            return {"data": [trace(i) for i in ids]}
        return None

    return answer


def consul_targets(server: str, services: list[str]) -> list[dict]:
    """Prometheus HTTP SD targets with the labels consul_sd_configs gives, from Consul's health endpoint."""
    groups = []
    for name in services:
        with urllib.request.urlopen(f"http://{server}/v1/health/service/{name}", timeout=10) as response:
            entries = json.load(response)
        for entry in entries:
            service, statuses = entry["Service"], {c["Status"] for c in entry["Checks"]}
            health = next((s for s in ("critical", "warning") if s in statuses), "passing")
            address = service["Address"] or entry["Node"]["Address"]
            labels = {"__meta_consul_service": name, "__meta_consul_service_id": service["ID"],
                      "__meta_consul_service_address": address, "__meta_consul_service_port": str(service["Port"]),
                      "__meta_consul_health": health, "__meta_consul_node": entry["Node"]["Node"],
                      "__meta_consul_tags": "," + ",".join(service.get("Tags") or []) + ","}
            for key, value in (service.get("Meta") or {}).items():
                labels["__meta_consul_service_metadata_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
            groups.append({"targets": [f"{address}:{service['Port']}"], "labels": labels})
    return groups


def consul_sd(path: str, query: dict[str, list[str]]):
    """The adapter's answer: GET /consul?server=HOST:PORT&services=a,b → HTTP SD target groups."""
    if path != "/consul":
        return None
    return consul_targets(query["server"][0], query["services"][0].split(","))


def with_http_sd(config: dict, sd_port: int) -> dict:
    """CONFIG with each consul_sd_configs entry replaced by http_sd_configs against the adapter; the rest as is."""
    for scrape in config.get("scrape_configs", []):
        for consul in scrape.pop("consul_sd_configs", []):
            query = urllib.parse.urlencode({"server": consul.get("server", "localhost:8500"),
                                            "services": ",".join(consul.get("services", []))})
            scrape.setdefault("http_sd_configs", []).append(
                {"url": f"http://127.0.0.1:{sd_port}/consul?{query}", "refresh_interval": "5s"})
    return config


def run_prometheus(config_path: str, stop: threading.Event, listen: str = "0.0.0.0:9090", sd_port: int = SD_PORT,
                   workdir: str = "/tmp") -> int:
    """Prometheus on `listen` with CONFIG's Consul SD through the adapter on loopback `sd_port`, until `stop`."""
    with open(config_path) as f:
        config = with_http_sd(yaml.safe_load(f), sd_port)
    rewritten = Path(workdir, "prometheus-stand-in.yml")
    rewritten.write_text(json.dumps(config))  # JSON is YAML
    adapter = json_server("127.0.0.1", sd_port, consul_sd)
    server = subprocess.Popen(["prometheus", f"--config.file={rewritten}", f"--web.listen-address={listen}",
                               f"--storage.tsdb.path={Path(workdir, 'prometheus-data')}", "--log.level=warn"])
    threading.Thread(target=lambda: (stop.wait(), server.terminate()), daemon=True).start()
    print("prometheus stand-in serving (Debian's prometheus, Consul through HTTP SD)", flush=True)
    code = server.wait()
    adapter.shutdown()
    return 0 if stop.is_set() else code


def main(argv: list[str]) -> int:
    if argv[:1] not in (["consul"], ["jaeger"], ["prometheus"]) or (argv[0] == "prometheus") != (len(argv) == 2):
        print("usage: python -m tests.integration.compose_stand_ins consul | jaeger | prometheus CONFIG",
              file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if argv[0] == "prometheus":
        return run_prometheus(argv[1], stop)
    if argv[0] == "consul":
        stand_in, query = ConsulDouble("0.0.0.0", 8500).start(), None
    else:
        stand_in = OtlpReceiver("0.0.0.0", 4317).start()
        query = json_server("0.0.0.0", JAEGER_QUERY_PORT, jaeger_query(stand_in))
    print(f"{argv[0]} stand-in serving", flush=True)
    stop.wait()
    if query is not None:
        query.shutdown()
    stand_in.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

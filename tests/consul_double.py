"""A double of the parts of Consul's HTTP API that disagg uses, for machines where no Consul server
can be installed (compose runs the real `hashicorp/consul` image).

Implemented to Consul's documented request and response shapes
(https://developer.hashicorp.com/consul/api-docs/agent/service,
 https://developer.hashicorp.com/consul/api-docs/agent/check,
 https://developer.hashicorp.com/consul/api-docs/health#list-service-instances-for-service,
 https://developer.hashicorp.com/consul/api-docs/features/blocking):

- PUT  /v1/agent/service/register            body: Name, ID, Address, Port, Tags, Meta, Check | Checks
                                              (field names case-insensitive, as Consul decodes them)
- PUT  /v1/agent/service/deregister/<id>
- GET  /v1/agent/services                     {id: {ID, Service, Tags, Meta, Port, Address}}
- GET  /v1/agent/checks                       {check_id: {Node, CheckID, Name, Status, ServiceID, ServiceName, Output, Type}}
- GET  /v1/health/service/<name>[?passing][&index=N&wait=Ds]
                                              [{Node: {Node, Address}, Service: {...}, Checks: [...]}],
                                              X-Consul-Index header; with `index`, the call blocks until the
                                              index moves past it or `wait` (default 5m, capped 10m) passes.

Like the agent, it runs each service's GRPC check itself (grpc.health.v1 Check against
"host:port[/service]" every Interval, with Timeout): SERVING → passing, anything else or an error
→ critical; a check critical for longer than DeregisterCriticalServiceAfter deregisters its
service. New registrations start critical, as Consul's checks do until their first run.
Not implemented (disagg does not use them): ACLs, datacenters, catalog and KV endpoints.
"""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

NODE = {"ID": "double-node", "Node": "consul-double", "Address": "127.0.0.1", "Datacenter": "dc1"}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str | None, default_s: float) -> float:
    """Consul's Go-style durations: "10s", "1.5m", "250ms"."""
    if not text:
        return default_s
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"bad duration {text!r}")
    return float(match[1]) * _UNIT_S[match[2]]


def _lower_keys(value):
    if isinstance(value, dict):
        return {k.lower(): _lower_keys(v) if k.lower() != "meta" else v for k, v in value.items()}
    if isinstance(value, list):
        return [_lower_keys(v) for v in value]
    return value


@dataclass
class Check:
    check_id: str
    service_id: str
    service_name: str
    grpc_target: str
    interval_s: float
    timeout_s: float
    deregister_after_s: float | None
    status: str = "critical"
    output: str = "not yet run"
    critical_since: float = field(default_factory=time.monotonic)
    next_run: float = 0.0

    def as_json(self) -> dict:
        return {"Node": NODE["Node"], "CheckID": self.check_id, "Name": f"Service '{self.service_name}' check",
                "Status": self.status, "Notes": "", "Output": self.output, "ServiceID": self.service_id,
                "ServiceName": self.service_name, "Type": "grpc"}


class ConsulDouble:
    """Start with `start()`, point clients at `address`, `stop()` at the end."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.services: dict[str, dict] = {}
        self.checks: dict[str, Check] = {}
        self.index = 1
        self.requests: list[tuple[str, str, str]] = []  # (method, path, query) seen, for tests
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._threads = [threading.Thread(target=self._server.serve_forever, daemon=True),
                         threading.Thread(target=self._run_checks, daemon=True)]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "ConsulDouble":
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._changed:
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()

    # --- state ---

    def _bump(self) -> None:
        with self._changed:
            self.index += 1
            self._changed.notify_all()

    def register(self, body: dict) -> None:
        spec = _lower_keys(body)
        name = spec["name"]
        service_id = spec.get("id") or name
        self.deregister(service_id, bump=False)
        self.services[service_id] = {"ID": service_id, "Service": name, "Tags": spec.get("tags") or [],
                                     "Meta": spec.get("meta") or {}, "Port": int(spec.get("port") or 0),
                                     "Address": spec.get("address") or ""}
        checks = spec.get("checks") or ([spec["check"]] if spec.get("check") else [])
        for i, check in enumerate(checks):
            if "grpc" not in check:
                raise ValueError("this double runs GRPC checks only")
            check_id = check.get("checkid") or check.get("id") or f"service:{service_id}" + (f":{i + 1}" if i else "")
            deregister = check.get("deregistercriticalserviceafter")
            self.checks[check_id] = Check(check_id, service_id, name, check["grpc"],
                                          parse_duration(check.get("interval"), 10.0),
                                          parse_duration(check.get("timeout"), 10.0),
                                          parse_duration(deregister, 0) if deregister else None)
        self._bump()

    def deregister(self, service_id: str, bump: bool = True) -> bool:
        known = self.services.pop(service_id, None) is not None
        for check_id in [c for c, check in self.checks.items() if check.service_id == service_id]:
            del self.checks[check_id]
        if known and bump:
            self._bump()
        return known

    def health(self, name: str, passing: bool) -> list[dict]:
        entries = []
        for service_id, service in list(self.services.items()):
            if service["Service"] != name:
                continue
            checks = [c for c in self.checks.values() if c.service_id == service_id]
            if passing and any(c.status != "passing" for c in checks):
                continue
            entries.append({"Node": NODE, "Service": service, "Checks": [c.as_json() for c in checks]})
        return entries

    # --- the agent's check runner ---

    def _run_checks(self) -> None:
        while not self._stopping.wait(0.05):
            now = time.monotonic()
            for check in list(self.checks.values()):
                if now >= check.next_run:
                    check.next_run = now + check.interval_s
                    self._run(check)

    def _run(self, check: Check) -> None:
        target, _, service = check.grpc_target.partition("/")
        try:
            with grpc.insecure_channel(target) as channel:
                status = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=check.timeout_s).status
            ok = status == health_pb2.HealthCheckResponse.SERVING
            output = f"gRPC health check: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
        except grpc.RpcError as exc:
            ok, output = False, f"gRPC health check failed: {exc.code().name}"
        new_status = "passing" if ok else "critical"
        check.output = output
        if new_status != check.status:
            check.status = new_status
            check.critical_since = time.monotonic()
            self._bump()
        elif (not ok and check.deregister_after_s is not None
              and time.monotonic() - check.critical_since > check.deregister_after_s):
            self.deregister(check.service_id)

    # --- HTTP ---

    def _handler(self):
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _reply(self, code: int, body=None, index: int | None = None) -> None:
                data = json.dumps(body).encode() if body is not None else b""
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                if index is not None:
                    self.send_header("X-Consul-Index", str(index))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                url = urllib.parse.urlparse(self.path)
                double.requests.append(("PUT", url.path, url.query))
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                if url.path == "/v1/agent/service/register":
                    try:
                        double.register(body)
                    except (KeyError, ValueError) as exc:
                        return self._reply(400, f"Invalid service definition: {exc}")
                    return self._reply(200, True)
                match = re.fullmatch(r"/v1/agent/service/deregister/(.+)", url.path)
                if match:
                    if not double.deregister(urllib.parse.unquote(match[1])):
                        return self._reply(404, f'Unknown service ID "{match[1]}"')
                    return self._reply(200, True)
                self._reply(404, "not implemented by the double")

            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
                double.requests.append(("GET", url.path, url.query))
                if url.path == "/v1/agent/services":
                    return self._reply(200, dict(double.services))
                if url.path == "/v1/agent/checks":
                    return self._reply(200, {c.check_id: c.as_json() for c in double.checks.values()})
                match = re.fullmatch(r"/v1/health/service/(.+)", url.path)
                if match:
                    return self._health(urllib.parse.unquote(match[1]), query)
                self._reply(404, "not implemented by the double")

            def _health(self, name: str, query: dict) -> None:
                passing = "passing" in query and query["passing"][0].lower() not in ("0", "false")
                if "index" in query:  # a blocking query: wait for the index to move past the caller's
                    seen = int(query["index"][0])
                    wait = min(parse_duration(query.get("wait", [None])[0], 300.0), 600.0)
                    deadline = time.monotonic() + wait
                    with double._changed:
                        while double.index <= seen and not double._stopping.is_set():
                            left = deadline - time.monotonic()
                            if left <= 0:
                                break
                            double._changed.wait(left)
                self._reply(200, double.health(name, passing), index=double.index)

        return Handler

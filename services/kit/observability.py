"""What every service process does to be seen: Prometheus endpoint, OTel tracing, Consul registration.

    obs = Observability.from_args("prefill", model_name, args)   # tracing is set up here
    ... start the gRPC server (its interceptors pick tracing up) ...
    await obs.start(bind_host, advertised_host, grpc_port, meta={...})   # metrics HTTP + Consul register
    ...
    await obs.deregister()                                       # draining: out of Consul
    await obs.stop()                                             # deregister, flush spans
"""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

from common import tls
from common.discovery.consul import ConsulSettings, ServiceRegistration, add_consul_args, consul_from_args
from common.telemetry import tracing
from common.telemetry.metrics import Metrics
from services.kit.ports import port_taken

log = logging.getLogger(__name__)


def add_observability_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("metrics and tracing (tracing: OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME)")
    g.add_argument("--metrics-port", type=int, default=int(os.environ.get("DISAGG_METRICS_PORT", 0)),
                   help="Prometheus /metrics port; 0 picks a free one, -1 turns it off (env DISAGG_METRICS_PORT)")
    add_consul_args(parser)


@dataclass
class Observability:
    role: str
    metrics: Metrics
    metrics_port: int  # requested; the bound one after start()
    consul: ConsulSettings | None
    registration: ServiceRegistration | None = None

    @classmethod
    def from_args(cls, role: str, model: str, args: argparse.Namespace) -> "Observability":
        tracing.setup_tracing(role)
        return cls(role, Metrics.create(role, model), args.metrics_port, consul_from_args(args))

    async def start(self, bind_host: str, advertised_host: str, grpc_port: int,
                    meta: dict[str, str] | None = None) -> None:
        if self.metrics_port >= 0:
            try:
                self.metrics_port = self.metrics.serve(bind_host, self.metrics_port)
            except OSError as exc:
                raise port_taken(bind_host, self.metrics_port, "--metrics-port (0 picks a free one)", exc) from None
            print(f"disagg-{self.role} metrics on http://{advertised_host}:{self.metrics_port}/metrics", flush=True)
        if self.consul is not None:
            self.registration = ServiceRegistration(
                self.consul, self.role, advertised_host, grpc_port,
                tags=[f"role={self.role}", f"model={self.metrics.model}"],
                meta={**(meta or {}), "metrics_port": str(max(self.metrics_port, 0)), "model": self.metrics.model},
                grpc_use_tls=tls.current().serves_tls)
            await self.registration.register()

    async def deregister(self) -> None:
        """Leave Consul, so that routers stop sending work: the first step of a drain."""
        if self.registration is not None:
            await self.registration.deregister()
            self.registration = None

    async def stop(self) -> None:
        """Deregister (if the drain has not yet), then flush the spans."""
        await self.deregister()
        tracing.shutdown_tracing()

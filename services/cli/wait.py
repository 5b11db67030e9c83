"""`disagg wait [--router HOST:PORT] [--timeout S]`: until the router's grpc.health.v1 says SERVING (it is up and
has heard from its workers, a decode worker among them), for scripts that start one and then use it. Exit 0 when
it does, 1 (one line) when it does not in time. Torch-free: `disagg generate` waits the same way. --api-key (or
DISAGG_API_KEY) is sent too, for a router whose health asks one (--api-key-protects-health)."""
from __future__ import annotations

import argparse
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import channels, tls
from common.errors import InvalidConfig
from services.kit.auth import add_client_api_key_arg, client_key, grpc_metadata

# A router that is still starting refuses connections; gRPC then backs off before it dials again (1 s, growing
# to 2 min by default). Dial often, so that the wait ends within a poll of the router coming up.
_DIAL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                 ("grpc.max_reconnect_backoff_ms", 500))
_POLL_S = 0.2


def wait_serving(address: str, timeout_s: float, metadata: tuple[tuple[str, str], ...] = ()) -> str | None:
    """None once `address` answers health SERVING within `timeout_s`, else what it last answered (one phrase).
    `metadata` goes with each check (an API key)."""
    deadline = time.monotonic() + timeout_s
    with channels.sync_channel(address, _DIAL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), metadata=metadata,
                                    timeout=max(0.1, min(2.0, deadline - time.monotonic()))).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return None
                problem = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as exc:
                problem = f"{exc.code().name}: {exc.details()}"
            if time.monotonic() + _POLL_S > deadline:
                return problem
            time.sleep(_POLL_S)


def main(argv: list[str] | None = None) -> int:
    from services.cli.client import DEFAULT_ROUTER

    parser = argparse.ArgumentParser(prog="disagg wait", description=__doc__)
    parser.add_argument("--router", default=DEFAULT_ROUTER, help="host:port of the router (env DISAGG_ROUTER)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait (default 60)")
    add_client_api_key_arg(parser)
    tls.add_tls_args(parser)
    args = parser.parse_args(argv)
    try:
        tls.configure(tls.tls_from_args(args))
    except InvalidConfig as exc:
        parser.error(str(exc))
    started = time.monotonic()
    problem = wait_serving(args.router, args.timeout, grpc_metadata(client_key(args)))
    if problem is not None:
        print(f"disagg wait: {args.router} is not SERVING after {args.timeout:g}s ({problem})", file=sys.stderr)
        return 1
    print(f"{args.router} is SERVING (after {time.monotonic() - started:.1f}s)")
    return 0

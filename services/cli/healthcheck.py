"""`python -m services.cli.healthcheck [HOST:PORT] [--http PORT|URL]`: exit 0 when the server's grpc.health.v1 says
SERVING (and, with --http, the router's OpenAI-compatible front door answers 200 on /health).

For container health checks (docker compose `healthcheck`); the address defaults to this container's own port from
DISAGG_GRPC_PORT (which sets its server's --port). Plaintext, or TLS when DISAGG_TLS_CA or --tls-ca is set (common.tls);
the HTTP check is HTTPS where this container serves TLS (DISAGG_TLS_CERT). The router's API key (DISAGG_API_KEY,
DISAGG_API_KEY_FILE) goes with both, for a router whose health asks one."""
from __future__ import annotations

import argparse
import os
import sys
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import channels, tls
from services.kit.auth import client_key, grpc_metadata, http_headers
from services.kit.ports import GRPC_PORT_ENV


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.cli.healthcheck", description=__doc__)
    parser.add_argument("address", nargs="?", default=f"127.0.0.1:{os.environ.get(GRPC_PORT_ENV, '50051')}")
    parser.add_argument("--service", default="", help="health service name ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--http", default=None,
                        help="also require 200 from the HTTP front door's /health: a port (on 127.0.0.1) or a URL")
    tls.add_tls_args(parser)
    args = parser.parse_args(argv)
    tls.configure(tls.tls_from_args(args))
    key = client_key(argparse.Namespace())
    try:
        with channels.sync_channel(args.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout,
                metadata=grpc_metadata(key)).status
    except grpc.RpcError as exc:
        print(f"{args.address}: {exc.code().name}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{args.address}: {name}")
    if status != health_pb2.HealthCheckResponse.SERVING:
        return 1
    return 0 if args.http is None else _check_http(args.http, args.timeout, key)


def _check_http(target: str, timeout_s: float, key: str | None) -> int:
    settings = tls.current()
    url = target if "://" in target else f"{'https' if settings.serves_tls else 'http'}://127.0.0.1:{target}/health"
    context = settings.client_ssl_context() if url.startswith("https://") and settings.dials_tls else None
    try:
        request = urllib.request.Request(url, headers=http_headers(key))
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            print(f"{url}: HTTP {response.status}")
            return 0 if response.status == 200 else 1
    except OSError as exc:  # URLError and HTTPError (503: not ready) are OSErrors
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""`python -m services.healthcheck [HOST:PORT]`: exit 0 when the server's grpc.health.v1 says SERVING.

For container health checks (docker compose `healthcheck`); the address defaults to this container's
own port from DISAGG_GRPC_PORT. Plaintext, or TLS when DISAGG_TLS_CA is set (common.tls).
"""
from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import channels, tls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.healthcheck", description=__doc__)
    parser.add_argument("address", nargs="?", default=f"127.0.0.1:{os.environ.get('DISAGG_GRPC_PORT', '50051')}")
    parser.add_argument("--service", default="", help="health service name ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    tls.configure(tls.tls_from_args(argparse.Namespace()))
    try:
        with channels.sync_channel(args.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout).status
    except grpc.RpcError as exc:
        print(f"{args.address}: {exc.code().name}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{args.address}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())

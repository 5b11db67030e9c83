"""A worker, router or front door started on a port another process holds exits at once with one line naming the
port (and exit code 2), not a traceback; gRPC's SO_REUSEPORT no longer lets it bind beside the holder."""
from __future__ import annotations

import socket
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from services.kit.ports import IN_USE
from tests.integration.processes import REPO_ROOT
from tests.integration.test_up import text_model  # noqa: F401 (a fixture)

NOT_A_WORKER = "127.0.0.1:1"  # the router contacts its workers only after it has bound its ports


@pytest.mark.slow
def test_a_process_on_a_taken_port_exits_with_one_line_naming_it(text_model):  # noqa: F811
    holder = grpc.server(futures.ThreadPoolExecutor(1))  # gRPC's defaults: SO_REUSEPORT on
    grpc_port = holder.add_insecure_port("127.0.0.1:0")
    holder.start()
    plain = socket.create_server(("127.0.0.1", 0))
    http_port = plain.getsockname()[1]
    router = ("--model", text_model, "--prefill-workers", NOT_A_WORKER, "--decode-workers", NOT_A_WORKER)
    cases = {  # command → the line it must print
        ("prefill", "--model", text_model, "--port", str(grpc_port)):
            f"disagg prefill: 127.0.0.1:{grpc_port} {IN_USE}; choose another --port",
        ("router", *router, "--port", str(grpc_port), "--http-port", "0"):
            f"disagg router: 127.0.0.1:{grpc_port} {IN_USE}; choose another --port",
        ("router", *router, "--port", "0", "--http-port", str(http_port)):
            f"disagg router: 127.0.0.1:{http_port} {IN_USE}; choose another --http-port (0 turns HTTP off)",
    }
    try:
        started = {args: subprocess.Popen([sys.executable, "-m", "services", *args], cwd=REPO_ROOT, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                   for args in cases}
        for args, process in started.items():
            try:
                output, _ = process.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                output = process.communicate()[0]
            assert (process.returncode, output.splitlines()) == (2, [cases[args]]), " ".join(args)
    finally:
        holder.stop(0)
        plain.close()

"""Zero-leak checks for worker processes: every KV block free, no session, no stored tensor, no request.

    assert_no_leaks([prefill, decode])   # polls GetLoad until idle (the server may finish after replying)
"""
from __future__ import annotations

import time

import grpc

from benchmarks.processes import ServiceProcess
from benchmarks.worker_load import leaks, load_of  # noqa: F401 (tests import load_of from here)
from common.pb.disagg.v1 import worker_pb2


def assert_no_leaks(processes: list[ServiceProcess], timeout_s: float = 15.0) -> list[worker_pb2.Load]:
    """Every worker idle within `timeout_s` (cancels and releases finish in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = [load_of(p) for p in processes]
        held = {p.name: leaks(load) for p, load in zip(processes, loads) if leaks(load)}
        if not held:
            return loads
        if time.monotonic() > deadline:
            raise AssertionError(f"workers not back to their start after {timeout_s:g}s: {held}")
        time.sleep(0.05)


def rpc_error_of(call) -> grpc.RpcError:
    """The RpcError a sync streaming call ends with (AssertionError if it ends without one)."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as error:
        return error
    raise AssertionError("the call ended without an error")

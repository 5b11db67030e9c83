"""Zero-leak checks for worker processes: every KV block free, no session, no stored tensor, no request.

    assert_no_leaks([prefill, decode])   # polls GetLoad until idle (the server may finish after replying)
"""
from __future__ import annotations

import time

import grpc

from common.pb.disagg.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.processes import ServiceProcess


def load_of(process: ServiceProcess) -> worker_pb2.Load:
    with process.channel() as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)


def leaks(load: worker_pb2.Load) -> list[str]:
    """What a worker still holds, in words; empty when it is back to its start."""
    found = []
    if load.kv_blocks_free != load.kv_blocks_total:
        found.append(f"{load.kv_blocks_total - load.kv_blocks_free} of {load.kv_blocks_total} KV blocks held")
    for name in ("active_kv_sessions", "stored_tensors", "running_requests", "waiting_requests"):
        if getattr(load, name):
            found.append(f"{name}={getattr(load, name)}")
    return found


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

"""A worker's Load (GetLoad) and what it still holds, for the soak bench and the tests' zero-leak checks."""
from __future__ import annotations

from benchmarks.processes import ServiceProcess
from common.pb.disagg.v1 import worker_pb2, worker_pb2_grpc


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

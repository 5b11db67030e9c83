"""Idle means idle: once `disagg up` has served requests (decode pulling from prefill, through NIXL where it runs
here: its agents and the exporter's progress thread are then up), no process of it spends CPU while nothing moves."""
from __future__ import annotations

import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.cpu_time import cores_used, process_tree
from common.kv.transports.nixl import nixl_unavailable_reason
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.integration.test_up import Up, text_model  # noqa: F401 (a fixture)

QUIET_WINDOW_S = 5.0
MAX_IDLE_CORES = 0.05  # per process
PROMPTS = ["The sea is", "Once upon a time " * 12, "Hello"]


def _pulled_bytes(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "disagg_kv_pull_bytes_total")


def _name(pid: int) -> str:
    return " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[1:4])


@pytest.mark.slow
def test_every_process_of_disagg_up_is_idle_after_serving(text_model):  # noqa: F811
    backends = "auto" if nixl_unavailable_reason() is not None else "nixl,grpc"
    up = Up("--model", text_model, "--router-port", "0", env={"DISAGG_KV_TRANSPORTS": backends,
                                                               "OMP_NUM_THREADS": "1"})
    try:
        router = up.wait()
        with grpc.insecure_channel(router) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for prompt in PROMPTS:
                request = generation_pb2.GenerateRequest(
                    prompt=prompt, sampling=common_pb2.SamplingParams(temperature=0, max_tokens=5))
                assert list(stub.Generate(request, timeout=60))[-1].HasField("finished")
        metrics = up.metrics_urls()
        assert _pulled_bytes(metrics["decode-0"]) > 0, "decode pulled nothing from prefill:\n" + "".join(up.lines)
        pids = process_tree(up.popen.pid)
        assert len(pids) == 4, "".join(up.lines)  # disagg up, router, prefill, decode
        used = cores_used(pids, QUIET_WINDOW_S)
        busy = {f"{pid} ({_name(pid)})": f"{cores:.1%}" for pid, cores in used.items() if cores > MAX_IDLE_CORES}
        assert not busy, f"busy while idle over {QUIET_WINDOW_S:g}s (KV backends {backends}): {busy}"
    finally:
        assert up.stop() == 0, "".join(up.lines)

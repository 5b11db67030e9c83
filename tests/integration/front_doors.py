"""One `disagg up` cluster that every front-door test shares, per mode: the gRPC port (disagg.v1 and KServe v2) and
the OpenAI-compatible HTTP port, the workers as tests.integration.leaks reads them, the router's metrics URL.

Its tiny random text model has a context widened to 8192 tokens (rotary positions: the weights do not change), so
a stream a client leaves mid-way is still generating while the leak check runs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import grpc
import openai

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.integration.processes import free_port
from tests.integration.test_router import make_text_model
from tests.integration.test_up import Up

MODES = {"prefill-decode": (), "aggregated": ("--prefill", "0")}
CONTEXT = 8192
ENGINE = ("--num-kv-blocks", str(CONTEXT // 16 + 64))  # one full context of 16-token blocks, and room besides
WORKER_LINE = re.compile(r"^\s+((?:prefill|decode)-\d+)\s+(\S+)\s+\(gRPC", re.M)


@dataclass(frozen=True)
class Worker:
    """A worker `disagg up` started, as tests.integration.leaks wants it: a name and a channel."""

    name: str
    address: str

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)


@dataclass
class Cluster:
    up: Up
    mode: str
    router: str  # the gRPC address: disagg.v1.Generation and inference.GRPCInferenceService
    http: str  # http://host:port of the OpenAI-compatible front door
    workers: list[Worker]
    metrics: str  # the router's Prometheus URL
    model: str = field(default="")  # the served model's name

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.http}/v1", api_key="unused", max_retries=0, timeout=60)

    def log(self) -> str:
        return "".join(self.up.lines)

    def native_text(self, max_tokens: int, **request) -> str:
        """The text of a greedy disagg.v1 Generate: what every other front door must give."""
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens)
        with grpc.insecure_channel(self.router) as channel:
            responses = generation_pb2_grpc.GenerationStub(channel).Generate(
                generation_pb2.GenerateRequest(sampling=sampling, **request), timeout=60)
            return "".join(r.delta.text for r in responses if r.HasField("delta"))


def make_front_door_model(directory: Path) -> str:
    return str(make_text_model(directory, max_position_embeddings=CONTEXT))


def run_cluster(model: str, mode: str, *flags: str) -> Iterator[Cluster]:
    """`disagg up` of `model` in `mode`, with `flags` besides."""
    http_port = free_port()  # `disagg up --http-port 0` turns HTTP off, so a free port is chosen here
    up = Up("--model", model, "--router-port", "0", "--http-port", str(http_port), *ENGINE, *MODES[mode], *flags)
    try:
        router = up.wait()
        up.wait_line("A process that dies is restarted", 10)  # the banner's last line: it is all there
        lines = "".join(up.lines)
        workers = [Worker(*m) for m in WORKER_LINE.findall(lines)]
        assert [w.name for w in workers] == (["decode-0"] if MODES[mode] else ["prefill-0", "decode-0"]), lines
        assert f"OpenAI-compatible HTTP on http://127.0.0.1:{http_port}/v1" in lines, lines
        metrics = up.metrics_urls()["router"]  # the banner's table
        cluster = Cluster(up, mode, router, f"http://127.0.0.1:{http_port}", workers, metrics)
        cluster.model = cluster.sdk().models.list().data[0].id
        yield cluster
    finally:
        assert up.stop() == 0, "".join(up.lines)

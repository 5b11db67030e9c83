"""The TTFT breakdown end to end (tiny model; real router, prefill and decode processes; a real OTLP receiver):
it arrives in Finished.usage prefill → decode and aggregated, every part >= 0, router queue + prefill queue + prefill
compute leading to the router's ttft_ms (less the Prefill call's transit), KV handoff + first decode step fitting
between the client's first and second tokens; the router exports it on /metrics and on the request's span, and
`disagg bench` prints it through the gRPC and OpenAI front doors and says why KServe has none."""
from __future__ import annotations

import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterator

import grpc
import pytest

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.integration.conftest import TracedWorkers
from tests.integration.observed import scrape, wait_for
from tests.integration.otlp_receiver import OtlpReceiver
from tests.integration.processes import REPO_ROOT, ServiceProcess, free_port, start_service

PARTS = ("router_queue_ms", "prefill_queue_ms", "prefill_compute_ms", "kv_handoff_ms", "first_decode_step_ms")
FIRST_TOKEN_PARTS = PARTS[:3]
NUM_REQUESTS = 4
# What the three parts may leave of the router's ttft_ms: the Prefill (or aggregated Decode) call's gRPC transit
# both ways on loopback and the worker's answer after its first token. 2-4 ms on an idle 2-core machine, up to 14 ms
# measured with a load average of 14 on it.
TRANSIT_MS = 40.0
# Tokens reach the client through gRPC and a Python thread: one may arrive up to this much later than the next.
CLIENT_JITTER_MS = 10.0
SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind
MIN_REMOTE = 16  # prompt tokens from which the router sends the prompt to the prefill worker
LONG = "the lighthouse keeper said that the sea was calm tonight and every ship would come home before dawn"
SHORT = "the harbour master said"


@dataclass
class Stack:
    model: str
    processes: list[ServiceProcess]  # prefill, decode, router

    @property
    def router(self) -> ServiceProcess:
        return self.processes[2]


@pytest.fixture(scope="module")
def receiver(traced_workers: TracedWorkers) -> OtlpReceiver:
    """The receiver of the shared traced workers (conftest.traced_workers), not a module one of its own."""
    return traced_workers.receiver


@pytest.fixture(scope="module")
def stack(traced_workers: TracedWorkers) -> Iterator[Stack]:
    """The shared traced prefill + decode (conftest.traced_workers) and a router of this module's over them (HTTP on)
    that runs prompts shorter than MIN_REMOTE tokens aggregated."""
    workers = traced_workers
    router = start_service("router", "--model", workers.model, "--prefill-workers", workers.prefill.address,
                           "--decode-workers", workers.decode.address, "--min-remote-prefill-tokens", str(MIN_REMOTE),
                           "--http-port", str(free_port()), env=workers.env)
    try:
        yield Stack(workers.model, [*workers.processes, router])
    finally:
        assert router.stop() == 0, router.log()


def _generate(router: ServiceProcess, prompt: str, metadata: tuple = ()) -> tuple[list[float], common_pb2.Usage]:
    """The client's arrival time (ms since sending) of each delta with tokens, and the Finished usage; a prompt of
    MIN_REMOTE tokens or more runs prefill → decode, a shorter one aggregated."""
    request = generation_pb2.GenerateRequest(
        prompt=prompt, sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4),
        stop=common_pb2.StopConditions(ignore_eos=True))
    arrivals, usage = [], None
    with grpc.insecure_channel(router.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10)  # connected before the clock starts
        start = time.perf_counter()
        for response in stub.Generate(request, metadata=metadata, timeout=30):
            if response.HasField("delta") and response.delta.token_ids:
                arrivals.append((time.perf_counter() - start) * 1000)
            elif response.HasField("finished"):
                usage = response.finished.usage
    assert usage is not None and usage.completion_tokens == 4
    return arrivals, usage


def _check_first_token_parts(usage: common_pb2.Usage) -> None:
    breakdown = usage.ttft_breakdown
    assert all(breakdown.HasField(part) and getattr(breakdown, part) >= 0 for part in FIRST_TOKEN_PARTS), breakdown
    to_first_token = sum(getattr(breakdown, part) for part in FIRST_TOKEN_PARTS)
    assert to_first_token <= usage.ttft_ms <= to_first_token + TRANSIT_MS, (usage.ttft_ms, breakdown)


def test_prefill_then_decode_reports_every_part_and_they_account_for_the_first_two_tokens(stack):
    for i in range(NUM_REQUESTS):
        arrivals, usage = _generate(stack.router, f"Request {i}: {LONG}")
        assert usage.prompt_tokens >= MIN_REMOTE
        _check_first_token_parts(usage)
        breakdown = usage.ttft_breakdown
        assert breakdown.HasField("kv_handoff_ms") and breakdown.HasField("first_decode_step_ms"), breakdown
        assert 0 < usage.kv_transfer_ms <= breakdown.kv_handoff_ms  # the pull is inside the handoff
        after_first = breakdown.kv_handoff_ms + breakdown.first_decode_step_ms
        assert after_first <= arrivals[1] - arrivals[0] + CLIENT_JITTER_MS, (arrivals, breakdown)


def test_aggregated_reports_the_decode_workers_prefill_and_no_handoff(stack):
    for i in range(NUM_REQUESTS):
        _, usage = _generate(stack.router, f"Request {i}: {SHORT}")
        assert usage.prompt_tokens < MIN_REMOTE
        _check_first_token_parts(usage)
        assert not usage.ttft_breakdown.HasField("kv_handoff_ms") and usage.ttft_breakdown.kv_handoff_ms == 0
        assert not usage.ttft_breakdown.HasField("first_decode_step_ms")
        assert usage.kv_transfer_backend == common_pb2.TRANSFER_BACKEND_UNSPECIFIED


def test_the_router_exports_the_parts_as_histograms_by_mode(stack):
    _generate(stack.router, f"One more: {LONG}")
    _generate(stack.router, f"One more: {SHORT}")
    samples = scrape(stack.router)

    def count(mode: str, part: str) -> float | None:
        return samples.get(f'disagg_ttft_breakdown_seconds_count{{mode="{mode}",part="{part}"}}')

    split, aggregated = count("prefill_decode", "router_queue"), count("aggregated", "router_queue")
    assert split > 0 and aggregated > 0 and split + aggregated == samples["disagg_time_to_first_token_seconds_count"]
    for part in (p.removesuffix("_ms") for p in PARTS):
        assert count("prefill_decode", part) == split, part
        assert samples[f'disagg_ttft_breakdown_seconds_sum{{mode="prefill_decode",part="{part}"}}'] > 0, part
    assert count("aggregated", "prefill_queue") == count("aggregated", "prefill_compute") == aggregated
    assert count("aggregated", "kv_handoff") is None and count("aggregated", "first_decode_step") is None


def test_the_requests_span_carries_the_parts(stack, receiver):
    trace_id = secrets.token_hex(16)
    _, usage = _generate(stack.router, f"A traced request: {LONG}",
                         metadata=(("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),))

    def generate_span():
        found = [s for s in receiver.trace(trace_id) if s.name == "/disagg.v1.Generation/Generate" and s.kind == SERVER]
        return found[0] if found else None

    span = wait_for(generate_span, 20, "the router's Generate span")
    assert span.attributes["disagg.ttft.mode"] == "prefill_decode"
    assert span.attributes["disagg.ttft_ms"] == pytest.approx(usage.ttft_ms)
    for part in PARTS:
        assert span.attributes[f"disagg.ttft.{part}"] == pytest.approx(getattr(usage.ttft_breakdown, part))


def test_bench_prints_the_breakdown_for_grpc_and_openai_and_says_kserve_has_none(stack):
    router = stack.router
    done = subprocess.run([sys.executable, "-m", "services", "bench", "--router", router.address, "--http",
                           router.http_url, "--api", "grpc,openai,kserve", "--tokenizer", stack.model,
                           "--num-prompts", "4", "--input-len", "uniform:24:40", "--output-len", "fixed:3",
                           "--max-concurrency", "2", "--warmup", "0", "--seed", "3", "--no-progress"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    tables = done.stdout.split("TTFT breakdown")
    assert len(tables) == 4, done.stdout  # one per front door
    for table in tables[1:3]:  # grpc, openai
        rows = {line[:28].strip(): line[28:].split() for line in table.splitlines() if len(line[28:].split()) == 5}
        for name in ("router queue", "prefill queue", "prefill compute", "other (network, gRPC)",
                     "of it router <-> worker", "of it client <-> router", "TTFT (client)", "KV handoff",
                     "first decode step"):
            assert rows[name][0] == "4" and all(float(v) >= 0 for v in rows[name][1:]), (name, table)
    assert "KServe v2 does not carry" in tables[3]

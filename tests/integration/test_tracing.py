"""One request through router → prefill → KV pull → decode is one OpenTelemetry trace, exported over OTLP/gRPC
to a real TraceService receiver, with the right parent links across the three processes; the client's own
W3C traceparent is the trace's root."""
from __future__ import annotations

import json
import secrets
import urllib.request
from typing import Iterator

import grpc
import pytest

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.integration.observed import wait_for
from tests.integration.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.integration.conftest import TracedWorkers
from tests.integration.processes import ServiceProcess, free_port, start_service

MAX_TOKENS = 5
SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


@pytest.fixture(scope="module")
def receiver(traced_workers: TracedWorkers) -> OtlpReceiver:
    """The receiver of the shared traced workers (conftest.traced_workers), not a module one of its own."""
    return traced_workers.receiver


@pytest.fixture(scope="module")
def traced(traced_workers: TracedWorkers) -> Iterator[ServiceProcess]:
    """A router over the shared traced prefill and decode (conftest.traced_workers), exporting to their receiver
    under its own OTEL_SERVICE_NAME."""
    workers = traced_workers
    router = start_service("router", "--model", workers.model, "--prefill-workers", workers.prefill.address,
                           "--decode-workers", workers.decode.address, "--http-port", str(free_port()),
                           env={**workers.env, "OTEL_SERVICE_NAME": "edge-router"})
    try:
        yield router
    finally:
        assert router.stop() == 0, router.log()


def _generate(router: ServiceProcess, metadata: tuple = ()) -> None:
    request = generation_pb2.GenerateRequest(
        prompt="The lighthouse keeper said", sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        stop=common_pb2.StopConditions(ignore_eos=True))
    with grpc.insecure_channel(router.address) as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, metadata=metadata, timeout=30))
    assert responses[-1].finished.usage.completion_tokens == MAX_TOKENS


def _one(spans: list[ReceivedSpan], service: str, name: str, kind: int | None = None) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name and (kind is None or s.kind == kind)]
    assert len(found) == 1, f"expected one {name!r} span of {service}, got {found}\nall: {spans}"
    return found[0]


def _complete(receiver: OtlpReceiver, trace_id: str):
    """The trace once it has its spans from all three processes, every parent but the root's has arrived, and every
    client span's server span too (each process exports in its own batches: decode's Pull can be in before the
    prefill worker's side of it)."""
    def check() -> list[ReceivedSpan] | None:
        spans = receiver.trace(trace_id)
        services = {s.service for s in spans}
        ids = {s.span_id for s in spans}
        roots = [s for s in spans if s.parent_span_id not in ids]
        served = {s.parent_span_id for s in spans if s.kind == SERVER}
        done = ({"edge-router", "disagg-prefill", "disagg-decode"} <= services and len(roots) == 1
                and sum(s.name == "decode" for s in spans) == 2 and any(s.name == "kv_pull" for s in spans)
                and all(s.span_id in served for s in spans if s.kind == CLIENT))
        return spans if done else None
    return check


def test_one_request_is_one_trace_across_router_prefill_and_decode(traced, receiver):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    _generate(traced, metadata=(("traceparent", f"00-{trace_id}-{client_span}-01"),))
    spans = wait_for(_complete(receiver, trace_id), 20, "the trace's spans from all three processes")

    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans)
    # The client's traceparent is honoured: the router's server span is its child, and everything hangs below.
    generate = _one(spans, "edge-router", "/disagg.v1.Generation/Generate", SERVER)
    assert generate.parent_span_id == client_span
    for span in spans:
        if span is not generate:
            assert span.parent_span_id in by_id, f"{span.name} of {span.service} has a parent outside the trace"

    def parent(span: ReceivedSpan) -> ReceivedSpan:
        return by_id[span.parent_span_id]

    assert parent(_one(spans, "edge-router", "tokenize")) is generate
    assert _one(spans, "edge-router", "tokenize").attributes["disagg.prompt_tokens"] > 0
    # router "prefill" → its gRPC client span → the prefill process's server span
    prefill = _one(spans, "edge-router", "prefill")
    assert parent(prefill) is generate
    prefill_server = _one(spans, "disagg-prefill", "/disagg.v1.Prefiller/Prefill", SERVER)
    assert parent(parent(prefill_server)) is prefill and parent(prefill_server).kind == CLIENT
    # router "decode" → the decode process's "decode" span → "kv_pull". The request travels on the router's shared
    # DecodeMany stream (whose RPC spans are the stream's, not the request's), its start carrying the trace context.
    decode = _one(spans, "edge-router", "decode")
    assert parent(decode) is generate and decode.attributes["disagg.decode.tokens"] == MAX_TOKENS - 1
    decode_work = _one(spans, "disagg-decode", "decode")
    assert parent(decode_work) is decode and decode_work.attributes["disagg.decode.tokens"] == MAX_TOKENS - 1
    assert not [s for s in spans if s.name.startswith("/disagg.v1.Decoder/")]  # the stream's spans are not the trace's
    kv_pull = _one(spans, "disagg-decode", "kv_pull")
    assert parent(kv_pull) is decode_work
    assert kv_pull.attributes["disagg.kv_pull.bytes"] > 0 and kv_pull.attributes["disagg.kv_pull.seconds"] > 0
    # ... whose TensorStore.Pull call is served (and traced) by the prefill process
    pull_server = _one(spans, "disagg-prefill", "/disagg.v1.TensorStore/Pull", SERVER)
    assert parent(parent(pull_server)) is kv_pull
    assert any("first_token" in s.events for s in spans if s.service == "edge-router")


def test_a_request_without_traceparent_starts_its_own_trace(traced, receiver):
    known = {s.trace_id for s in receiver.spans}
    _generate(traced)
    # The receiver is shared (conftest.traced_workers): a new trace of this module's router, the one it serves.
    new = wait_for(lambda: {s.trace_id for s in receiver.spans if s.service == "edge-router"} - known, 20,
                   "a new trace")
    assert len(new) == 1
    spans = wait_for(_complete(receiver, new.pop()), 20, "the new trace's spans")
    assert _one(spans, "edge-router", "/disagg.v1.Generation/Generate", SERVER).parent_span_id == ""


def test_an_openai_http_request_is_one_trace_too(traced, receiver):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"prompt": "The lighthouse keeper said", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(f"{traced.http_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "traceparent": f"00-{trace_id}-{client_span}-01"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == MAX_TOKENS
    spans = wait_for(_complete(receiver, trace_id), 20, "the HTTP request's spans from all three processes")
    by_id = {s.span_id: s for s in spans}
    http = _one(spans, "edge-router", "POST /v1/completions", SERVER)
    assert http.parent_span_id == client_span  # the client's traceparent header is honoured
    for name in ("tokenize", "prefill", "decode"):
        assert by_id[_one(spans, "edge-router", name).parent_span_id] is http
    assert all(s is http or s.parent_span_id in by_id for s in spans)

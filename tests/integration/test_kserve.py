"""The KServe v2 front door against `disagg up`, aggregated (--prefill 0) and prefill→decode: tritonclient (a
client none of us wrote, in .venv-tritonclient) gets the greedy text of the native disagg.v1 path and of Hugging
Face; a tritonclient stream stopped mid-generation frees every block on every worker; each bad request gets its
status and a message naming what is wrong, and the next request is served."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from common.pb.inference import grpc_service_pb2 as pb
from common.pb.inference import grpc_service_pb2_grpc as pb_grpc
from common.tokenizer import Tokenizer
from tests.hf_reference import hf_greedy
from tests.integration.front_doors import CONTEXT
from tests.integration.leaks import assert_no_leaks
from tests.integration.processes import REPO_ROOT
from tests.kserve_cases import BAD_CASES, BadCase, infer_request, prompt_request

TRITON_PYTHON = REPO_ROOT / ".venv-tritonclient" / "bin" / "python"
SCRIPT = Path(__file__).with_name("triton_client_script.py")
PROMPTS = ["The sea is", "Once upon a time"]
MAX_TOKENS = 12

needs_tritonclient = pytest.mark.skipif(not TRITON_PYTHON.exists(),
                                        reason="no .venv-tritonclient (deploy/install.sh makes it)")


@pytest.fixture(scope="module")
def text_model(front_door_model) -> str:
    return front_door_model


@pytest.fixture(scope="module")
def references(text_model) -> dict[str, str]:
    tokenizer = Tokenizer.from_model_dir(text_model)
    return {prompt: tokenizer.decode(hf_greedy(text_model, tokenizer.encode(prompt), MAX_TOKENS, stop_at_eos=True)[0])
            for prompt in PROMPTS}


def run_tritonclient(mode: str, **plan) -> dict:
    result = subprocess.run([str(TRITON_PYTHON), str(SCRIPT), mode, json.dumps(plan)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


@needs_tritonclient
def test_tritonclient_infer_and_stream_give_the_native_and_hf_greedy_text(front_doors, text_model, references):
    model = Path(text_model).name
    result = run_tritonclient("generate", url=front_doors.router, model=model, prompts=PROMPTS, max_tokens=MAX_TOKENS)
    metadata = result["metadata"]
    assert metadata["live"] and metadata["ready"] and metadata["model_ready"] and metadata["decoupled"]
    assert metadata["server"]["name"] == "disagg"
    assert metadata["inputs"]["text_input"] == ["BYTES", ["1"]]
    assert metadata["outputs"]["text_output"] == ["BYTES", ["-1"]]
    for prompt, unary, streamed in zip(PROMPTS, result["infer"], result["stream"], strict=True):
        native = front_doors.native_text(MAX_TOKENS, prompt=prompt)
        assert native == references[prompt], prompt
        assert unary == {"text": native, "finish_reason": "length", "id": "unary"}, prompt
        assert "".join(streamed["deltas"]) == native and len(streamed["deltas"]) > 1, prompt
        assert streamed["finish_reason"] == "length" and streamed["finals"] == 1, prompt
    errors = result["errors"]
    assert errors["infer_unknown_model"] == {
        "status": "StatusCode.NOT_FOUND", "message": f"model 'no-such-model' is not served here; this server serves '{model}'"}
    assert errors["stream_bad_temperature"]["message"] == (
        "[StatusCode.INVALID_ARGUMENT] input 'sampling_parameters' key 'temperature': temperature must be >= 0, "
        "got -2.0")
    assert result["after_errors"] == result["infer"][0]
    assert_no_leaks(front_doors.workers)


@needs_tritonclient
def test_a_tritonclient_stream_stopped_mid_generation_frees_every_block(front_doors, text_model):
    max_tokens = CONTEXT - 100
    left = run_tritonclient("walk_away", url=front_doors.router, model=Path(text_model).name, prompt=PROMPTS[0],
                            max_tokens=max_tokens, deltas=20)
    assert left["deltas"] == 20 and not left["finished"]
    started = time.monotonic()
    assert_no_leaks(front_doors.workers, timeout_s=10)
    freed_s = time.monotonic() - started
    # It was cancelled, not finished: at the pace of its first deltas it had far longer to run.
    remaining_s = (max_tokens - left["deltas"]) * left["seconds"] / left["deltas"]
    assert remaining_s > 3 * freed_s, (remaining_s, freed_s)


CORE_CASES = [  # refused by the core (the prompt's tokens against the context), not by the front door
    BadCase("prompt past the context", lambda m: prompt_request(m, "word " * CONTEXT),
            grpc.StatusCode.INVALID_ARGUMENT, f"the model's context is {CONTEXT} tokens"),
    BadCase("max_tokens past the context", lambda m: prompt_request(m, max_tokens=CONTEXT),
            grpc.StatusCode.INVALID_ARGUMENT, f"exceeds the model's context of {CONTEXT} tokens; ask for at most"),
]


def test_bad_requests_get_their_status_and_message_and_the_next_is_served(front_doors, text_model):
    model = Path(text_model).name
    with grpc.insecure_channel(front_doors.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for case in [*BAD_CASES, *CORE_CASES]:
            with pytest.raises(grpc.RpcError) as error:
                stub.ModelInfer(case.build(model), timeout=60)
            assert error.value.code() == case.code and case.words in error.value.details(), (case.name,
                                                                                            error.value.details())
        streamed = [case for case in [*BAD_CASES, *CORE_CASES] if not case.unary_only]
        requests = [_with_id(case.build(model), f"bad-{i}") for i, case in enumerate(streamed)]
        responses = list(stub.ModelStreamInfer(iter([*requests, prompt_request(model, request_id="good")]), timeout=60))
        served = stub.ModelInfer(prompt_request(model), timeout=60)
    answers = {r.infer_response.id: r.error_message for r in responses}
    for index, case in enumerate(streamed):
        assert answers[f"bad-{index}"].startswith(f"[{case.code}]") and case.words in answers[f"bad-{index}"]
    assert answers["good"] == "" and [o.name for o in served.outputs] == ["text_output", "finish_reason"]
    assert len(BAD_CASES) + len(CORE_CASES) >= 15
    assert_no_leaks(front_doors.workers)


def test_model_names_versions_and_typed_contents_through_the_router(front_doors, text_model):
    model = Path(text_model).name
    typed = infer_request(model, [("text_input", "BYTES", [1, 1], [PROMPTS[0]]), ("max_tokens", "INT32", [1], [4]),
                                  ("temperature", "FP32", [1], [0.0])], raw=False, version="1")
    with grpc.insecure_channel(front_doors.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answer = stub.ModelInfer(typed, timeout=60)
        assert stub.ModelReady(pb.ModelReadyRequest(name=model, version="1")).ready
        with pytest.raises(grpc.RpcError) as error:
            stub.ModelConfig(pb.ModelConfigRequest(name=model, version="2"))
    assert answer.model_name == model and answer.model_version == "1"
    texts = {o.name: raw[4:].decode() for o, raw in zip(answer.outputs, answer.raw_output_contents, strict=True)}
    assert texts == {"text_output": front_doors.native_text(4, prompt=PROMPTS[0]), "finish_reason": "length"}
    assert error.value.code() == grpc.StatusCode.NOT_FOUND and "has no version '2'" in error.value.details()


def _with_id(request: pb.ModelInferRequest, request_id: str) -> pb.ModelInferRequest:
    request.id = request_id
    return request

"""The gRPC contract: generated code in sync, API.md's names present, buf-style conventions."""
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor, json_format

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from common.pb.inference import grpc_service_pb2, grpc_service_pb2_grpc, model_config_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
FILES = [common_pb2.DESCRIPTOR, generation_pb2.DESCRIPTOR, worker_pb2.DESCRIPTOR]

# service -> {method: (client_streaming, server_streaming)}
SERVICES = {
    "Generation": {"Generate": (False, True), "GenerateStream": (True, True), "ListModels": (False, False)},
    "Prefiller": {"Prefill": (False, False)},
    "Decoder": {"Decode": (True, True), "DecodeMany": (True, True)},
    "Encoder": {"Encode": (False, False)},
    "TensorStore": {"Pull": (False, True), "Release": (False, False), "OpenKvCache": (False, False)},
    "Worker": {"GetInfo": (False, False), "GetLoad": (False, False), "SubscribeKvEvents": (False, True)},
}

# Fields API.md / DESIGN.md name; renaming or dropping one must fail here.
REQUIRED_FIELDS = {
    "SamplingParams": {"temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "max_tokens"},
    "StopConditions": {"stop", "stop_token_ids", "ignore_eos"},
    "OutputOptions": {"logprobs", "top_logprobs", "echo_prompt_token_ids"},
    "Usage": {"prompt_tokens", "completion_tokens", "cached_prompt_tokens", "ttft_ms", "e2e_ms", "ttft_breakdown"},
    "TtftBreakdown": {"router_queue_ms", "prefill_queue_ms", "prefill_compute_ms", "kv_handoff_ms",
                      "first_decode_step_ms"},
    "Delta": {"token_ids", "text", "logprobs"},
    "Finished": {"reason", "matched_stop", "usage", "error"},
    "Image": {"data", "data_url", "path"},
    "KvSessionRef": {
        "session_id", "request_id", "endpoint", "transfer_backend", "num_layers", "num_kv_heads", "head_dim",
        "block_size", "dtype", "num_tokens", "block_ids", "fingerprint", "first_token", "first_token_logprob",
        "expires_at_unix_ms", "attributes",
    },
    "EmbeddingRef": {"handle", "endpoint", "shape", "dtype", "content_hash", "placeholder_token_count"},
    "GenerateRequest": {"request_id", "model", "prompt", "token_ids", "chat", "images", "sampling", "stop", "output"},
    "GenerateStreamRequest": {"start", "cancel"},
    "GenerateResponse": {"request_id", "delta", "finished"},
    "PrefillRequest": {"request_id", "token_ids", "sampling", "embeddings"},
    "PrefillResponse": {"first_token", "first_token_logprob", "first_token_top_logprobs", "session", "cached_tokens",
                        "ttft_breakdown"},
    "DecodeStart": {
        "request_id", "token_ids", "first_token", "session", "sampling", "stop", "output", "request_type",
    },
    "DecodeClientMessage": {"start", "cancel"},
    "DecodeServerMessage": {"request_id", "delta", "finished"},
    "EncodeResponse": {"embeddings"},
    "TensorChunk": {"offset", "total_bytes", "data", "header"},
    "TensorHeader": {"shape", "dtype", "layout"},
    "WorkerInfo": {
        "role", "model", "fingerprint", "block_size", "num_layers", "num_kv_heads", "head_dim", "dtype",
        "max_model_len", "limits",
    },
    "Load": {
        "running_requests", "waiting_requests", "kv_blocks_total", "kv_blocks_free", "kv_usage_ratio",
        "active_kv_sessions", "stored_tensors",
    },
    "KvEvent": {"sequence", "stored", "removed", "cleared"},
    "BlockStored": {"block_hashes", "parent_hash", "num_tokens"},
    "BlockRemoved": {"block_hashes"},
}


def _message(name: str) -> descriptor.Descriptor:
    for file in FILES:
        if name in file.message_types_by_name:
            return file.message_types_by_name[name]
    raise KeyError(f"no message {name} in disagg.v1")


def _all_enums():
    for file in FILES:
        yield from file.enum_types_by_name.values()
        for message in file.message_types_by_name.values():
            yield from message.enum_types


def test_generated_code_is_up_to_date():
    result = subprocess.run(
        [sys.executable, "-m", "common.pb.generate", "--check"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_comment_only_proto_edit_makes_the_generated_code_stale(tmp_path):
    # In a subprocess, as the test above: grpc_tools' protoc extension crashes beside this process's imports.
    script = """
import shutil, sys
from pathlib import Path
from common.pb import generate
copy = Path(sys.argv[1]) / "protos"
shutil.copytree(generate.PROTO_DIR, copy)
worker = copy / "disagg/v1/worker.proto"
worker.write_text(worker.read_text() + "// a comment\\n")
generate.PROTO_DIR = copy
print([str(p) for p in generate.stale_files(generate.render())])
"""
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['disagg/v1/worker_pb2.py']"


def test_every_file_is_package_disagg_v1():
    assert {f.package for f in FILES} == {"disagg.v1"}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_service_has_the_api_methods_with_their_streaming_shape(service):
    file = generation_pb2.DESCRIPTOR if service == "Generation" else worker_pb2.DESCRIPTOR
    methods = file.services_by_name[service].methods_by_name
    assert set(methods) == set(SERVICES[service])
    for name, (client_streaming, server_streaming) in SERVICES[service].items():
        assert (methods[name].client_streaming, methods[name].server_streaming) == (client_streaming, server_streaming), name
    module = generation_pb2_grpc if service == "Generation" else worker_pb2_grpc
    for generated in (f"{service}Stub", f"{service}Servicer", f"add_{service}Servicer_to_server"):
        assert hasattr(module, generated)


@pytest.mark.parametrize("message", sorted(REQUIRED_FIELDS))
def test_message_has_the_api_fields(message):
    missing = REQUIRED_FIELDS[message] - set(_message(message).fields_by_name)
    assert not missing, f"{message} lacks {sorted(missing)}"


def test_every_enum_has_an_unspecified_zero():
    enums = list(_all_enums())
    assert {e.name for e in enums} >= {"FinishReason", "RequestType", "TransferBackend", "WorkerRole", "TensorKind"}
    for enum in enums:
        prefix = "".join(f"_{c}" if c.isupper() else c.upper() for c in enum.name).lstrip("_")
        assert enum.values_by_number[0].name == f"{prefix}_UNSPECIFIED", enum.name
        assert all(v.name.startswith(prefix + "_") for v in enum.values), enum.name


def test_request_type_mirrors_trtllm():
    names = set(common_pb2.RequestType.keys())
    assert {"REQUEST_TYPE_CONTEXT_ONLY", "REQUEST_TYPE_GENERATION_ONLY", "REQUEST_TYPE_CONTEXT_AND_GENERATION"} <= names


def test_every_sampling_field_is_optional():
    for field in common_pb2.SamplingParams.DESCRIPTOR.fields:  # a map (logit_bias) is unset when empty
        assert field.has_presence or field.message_type and field.message_type.GetOptions().map_entry, field.name
    params = common_pb2.SamplingParams(temperature=0.0, top_k=0)
    assert params.HasField("temperature") and params.HasField("top_k")
    assert not params.HasField("top_p") and not params.HasField("max_tokens")
    params.ClearField("temperature")
    assert not params.HasField("temperature")


def test_decode_start_without_session_is_aggregated():
    start = worker_pb2.DecodeStart(request_id="r", token_ids=[1, 2, 3])
    assert not start.HasField("session") and not start.HasField("first_token")
    assert start.request_type == common_pb2.REQUEST_TYPE_UNSPECIFIED


def _json_round_trip(request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    text = json_format.MessageToJson(request)
    return json_format.Parse(text, generation_pb2.GenerateRequest())


def test_generate_request_with_prompt_round_trips_through_json():
    request = generation_pb2.GenerateRequest(
        request_id="r1", model="m", prompt="Hello",
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=8, seed=7),
        stop=common_pb2.StopConditions(stop=["\n"], stop_token_ids=[2]),
        output=common_pb2.OutputOptions(logprobs=True, top_logprobs=3),
    )
    back = _json_round_trip(request)
    assert back == request
    assert back.WhichOneof("input") == "prompt"
    assert back.sampling.HasField("temperature") and back.sampling.temperature == 0.0
    assert not back.sampling.HasField("top_p")


def test_generate_request_with_chat_round_trips_through_json():
    request = generation_pb2.GenerateRequest(
        request_id="r2",
        chat=generation_pb2.Chat(messages=[
            generation_pb2.ChatMessage(role="system", content="Be brief."),
            generation_pb2.ChatMessage(role="user", content="Hi"),
        ]),
        images=[common_pb2.Image(data=b"\x89PNG")],
    )
    back = _json_round_trip(request)
    assert back == request
    assert back.WhichOneof("input") == "chat"
    assert [m.role for m in back.chat.messages] == ["system", "user"]


def test_generate_request_parses_grpcurl_style_json():
    request = json_format.Parse(
        '{"prompt": "Hi", "sampling": {"temperature": 0, "maxTokens": 4}}', generation_pb2.GenerateRequest()
    )
    assert request.prompt == "Hi" and request.sampling.max_tokens == 4
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0


# --- the vendored KServe v2 / Triton protos (protos/inference/): tritonclient must talk to us unchanged ---

KSERVE_METHODS = {  # method: (client_streaming, server_streaming)
    "ServerLive": (False, False), "ServerReady": (False, False), "ModelReady": (False, False),
    "ServerMetadata": (False, False), "ModelMetadata": (False, False), "ModelInfer": (False, False),
    "ModelStreamInfer": (True, True), "ModelConfig": (False, False),
}
# Field numbers as Triton's grpc_service.proto / model_config.proto have them; a renumbering breaks every client.
KSERVE_FIELDS = {
    "ModelInferRequest": {"model_name": 1, "model_version": 2, "id": 3, "parameters": 4, "inputs": 5, "outputs": 6,
                          "raw_input_contents": 7},
    "ModelInferRequest.InferInputTensor": {"name": 1, "datatype": 2, "shape": 3, "parameters": 4, "contents": 5},
    "ModelInferResponse": {"model_name": 1, "model_version": 2, "id": 3, "parameters": 4, "outputs": 5,
                           "raw_output_contents": 6},
    "ModelStreamInferResponse": {"error_message": 1, "infer_response": 2},
    "InferParameter": {"bool_param": 1, "int64_param": 2, "string_param": 3, "double_param": 4, "uint64_param": 5},
    "InferTensorContents": {"bool_contents": 1, "int_contents": 2, "int64_contents": 3, "uint_contents": 4,
                            "uint64_contents": 5, "fp32_contents": 6, "fp64_contents": 7, "bytes_contents": 8},
    "ModelMetadataResponse": {"name": 1, "versions": 2, "platform": 3, "inputs": 4, "outputs": 5},
    "ModelConfigResponse": {"config": 1},
}
MODEL_CONFIG_FIELDS = {
    "ModelConfig": {"name": 1, "platform": 2, "max_batch_size": 4, "input": 5, "output": 6, "backend": 17,
                    "model_transaction_policy": 19},
    "ModelInput": {"name": 1, "data_type": 2, "dims": 4, "optional": 8},
    "ModelTransactionPolicy": {"decoupled": 1},
}


def _numbers(file: descriptor.FileDescriptor, path: str) -> dict[str, int]:
    message = file.message_types_by_name[path.split(".")[0]]
    for nested in path.split(".")[1:]:
        message = message.nested_types_by_name[nested]
    return {f.name: f.number for f in message.fields}


def test_kserve_protos_are_package_inference_and_import_each_other():
    assert grpc_service_pb2.DESCRIPTOR.package == model_config_pb2.DESCRIPTOR.package == "inference"
    assert [d.name for d in grpc_service_pb2.DESCRIPTOR.dependencies] == ["inference/model_config.proto"]
    config_field = grpc_service_pb2.ModelConfigResponse.DESCRIPTOR.fields_by_name["config"]
    assert config_field.message_type is model_config_pb2.ModelConfig.DESCRIPTOR


def test_kserve_service_has_the_triton_methods_with_their_streaming_shape():
    service = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == "inference.GRPCInferenceService"
    for name, shape in KSERVE_METHODS.items():
        method = service.methods_by_name[name]
        assert (method.client_streaming, method.server_streaming) == shape, name
    assert hasattr(grpc_service_pb2_grpc, "add_GRPCInferenceServiceServicer_to_server")


def test_kserve_messages_keep_tritons_field_numbers():
    for path, numbers in KSERVE_FIELDS.items():
        assert {k: v for k, v in _numbers(grpc_service_pb2.DESCRIPTOR, path).items() if k in numbers} == numbers
    for path, numbers in MODEL_CONFIG_FIELDS.items():
        assert {k: v for k, v in _numbers(model_config_pb2.DESCRIPTOR, path).items() if k in numbers} == numbers


def test_vendored_protos_keep_their_license():
    folder = REPO_ROOT / "protos" / "inference"
    assert "Redistribution and use in source and binary forms" in (folder / "LICENSE").read_text()
    for proto in ("grpc_service.proto", "model_config.proto"):
        header = (folder / proto).read_text()[:2000]
        assert "NVIDIA CORPORATION & AFFILIATES. All rights reserved." in header, proto
        assert "Redistribution and use in source and binary forms" in header, proto

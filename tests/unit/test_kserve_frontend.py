"""The KServe v2 front door over a fake core: tensors in both wire formats, the LLM input mapping, every RPC
through a real in-process grpc.aio server, decoupled streaming, and each bad input's status and message."""
from __future__ import annotations

import asyncio
import json
import struct

import grpc
import pytest

from common import errors
from common.engine.request import SamplingParams
from common.pb.inference import grpc_service_pb2 as pb
from common.pb.inference import grpc_service_pb2_grpc as pb_grpc
from common.pb.inference import model_config_pb2 as config_pb
from services.router.frontends import kserve
from services.router.frontends.kserve_request import parse_request
from services.router.frontends.kserve_tensors import decode_inputs, encode_bytes
from services.router.generation import Finished, FinishReason, TextDelta, Usage
from tests.fake_core import HANG, FakeCore
from tests.kserve_cases import BAD_CASES, infer_request, prompt_request, raw_of
from tests.loopback_grpc import loopback_server

MODEL = "tiny"
WORDS = [TextDelta((7,), "Hello"), TextDelta((8,), ""), TextDelta((9,), " sea"),
         Finished(FinishReason.LENGTH, Usage(prompt_tokens=3, completion_tokens=3))]


def serve(core: FakeCore, scenario):
    """Runs `scenario(stub)` against a grpc.aio server with the KServe servicer on a free loopback port."""
    async def main():
        async with loopback_server(lambda server: kserve.add_to_server(server, core)) as (_, address):
            async with grpc.aio.insecure_channel(address) as channel:
                return await scenario(pb_grpc.GRPCInferenceServiceStub(channel))
    return asyncio.run(main())


def outputs_of(response: pb.ModelInferResponse) -> dict[str, str]:
    """{output name: its one BYTES element}, read the way tritonclient reads raw_output_contents."""
    found = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        assert tensor.datatype == "BYTES" and list(tensor.shape) == [1]
        (length,) = struct.unpack_from("<I", raw)
        assert len(raw) == 4 + length
        found[tensor.name] = raw[4:].decode()
    return found


def final_flag(response: pb.ModelInferResponse) -> bool:
    return response.parameters["triton_final_response"].bool_param


# --- tensors ---

def test_raw_and_typed_contents_decode_to_the_same_values():
    inputs = [("text_input", "BYTES", [1, 1], ["héllo"]), ("stop", "BYTES", [2], ["a", "\n"]),
              ("stream", "BOOL", [1], [True]), ("max_tokens", "INT32", [1], [7]),
              ("seed", "UINT64", [1], [2**63 - 1]), ("temperature", "FP32", [1], [0.5]),
              ("top_p", "FP64", [1], [0.25]), ("top_k", "INT64", [1], [3])]
    raw = decode_inputs(infer_request(MODEL, inputs, raw=True))
    typed = decode_inputs(infer_request(MODEL, inputs, raw=False))
    assert raw == typed
    assert raw["text_input"].values == ("héllo".encode(),) and raw["text_input"].shape == (1, 1)
    assert raw["stop"].values == (b"a", b"\n")
    assert raw["stream"].values == (True,) and raw["max_tokens"].values == (7,)
    assert raw["seed"].values == (2**63 - 1,) and raw["temperature"].values == (0.5,)


def test_raw_bytes_elements_may_be_empty_and_encode_back_identically():
    values = [b"", b"x", "日本".encode(), b"\x00\x01"]
    request = infer_request(MODEL, [("stop", "BYTES", [4], values)])
    assert request.raw_input_contents[0] == encode_bytes(values) == raw_of("BYTES", values)
    assert decode_inputs(request)["stop"].values == tuple(values)


@pytest.mark.parametrize("raw, words", [
    (b"\x05\x00\x00\x00abc", "raw BYTES element of 5 bytes runs past the content's end (3 left)"),
    (b"\x01\x00\x00\x00a\x01", "ends inside an element's 4-byte length prefix"),
])
def test_malformed_raw_bytes_name_the_input(raw, words):
    request = infer_request(MODEL, [("text_input", "BYTES", [1], ["x"])])
    request.raw_input_contents[0] = raw
    with pytest.raises(errors.InvalidRequest, match="input 'text_input'") as error:
        decode_inputs(request)
    assert words in str(error.value)


def test_tensor_format_errors_name_the_input():
    wrong_size = infer_request(MODEL, [("max_tokens", "INT32", [2], [1, 2])])
    wrong_size.raw_input_contents[0] = b"\x00" * 6
    wrong_field = infer_request(MODEL, [("max_tokens", "INT32", [1], [1])], raw=False)
    wrong_field.inputs[0].contents.fp32_contents.append(1.0)
    negative = infer_request(MODEL, [("stop", "BYTES", [1], ["a"])])
    negative.inputs[0].shape[0] = -1
    unknown_type = infer_request(MODEL, [("max_tokens", "INT32", [1], [1])])
    unknown_type.inputs[0].datatype = "INT128"
    shared = infer_request(MODEL, [("max_tokens", "INT32", [1], [1])])
    shared.inputs[0].parameters["shared_memory_region"].string_param = "region"
    short = infer_request(MODEL, [("stop", "BYTES", [3], ["a", "b"])])
    cases = [(wrong_size, "raw content has 6 bytes; 2 INT32 elements take 8"),
             (wrong_field, "datatype INT32 takes contents.int_contents, got contents.fp32_contents"),
             (negative, "shape [-1] has a negative dimension"),
             (unknown_type, "datatype 'INT128' is not supported"),
             (shared, "shared memory is not supported (parameter 'shared_memory_region')"),
             (short, "shape [3] holds 3 elements, the data has 2")]
    for request, words in cases:
        with pytest.raises(errors.InvalidRequest) as error:
            decode_inputs(request)
        assert str(error.value).startswith(f"input '{request.inputs[0].name}'") and words in str(error.value)


# --- the LLM mapping ---

def test_sampling_comes_from_the_json_object_and_the_scalar_inputs():
    sampling = {"temperature": "0.5", "top_p": 0.9, "max_tokens": "12", "stop": "\n\n", "ignore_eos": "true",
                "stop_token_ids": [2, 3], "min_p": 0.1, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                "frequency_penalty": "-0.25", "logit_bias": {"7": -100, "9": "2.5"}}
    request = infer_request(MODEL, [
        ("text_input", "BYTES", [1], ["The sea is"]), ("sampling_parameters", "BYTES", [1], [json.dumps(sampling)]),
        ("top_k", "INT32", [1], [5]), ("random_seed", "UINT64", [1], [42])], request_id="r-1")
    parsed = parse_request(request, MODEL)
    assert parsed.generation.prompt == "The sea is" and parsed.generation.model == MODEL
    assert parsed.generation.request_id.startswith("r-1-")  # unique for the core, the client's id still shows
    assert parsed.generation.params == SamplingParams(
        temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.1, seed=42, max_tokens=12,
        stop=("\n\n",), stop_token_ids=(2, 3), ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.25,
        logit_bias={7: -100.0, 9: 2.5})
    assert not parsed.stream and not parsed.empty_final
    assert parsed.reply.request_id == "r-1" and parsed.reply.outputs == ("text_output", "finish_reason")


def test_defaults_streaming_alias_outputs_and_parameters():
    request = infer_request(MODEL, [("text_input", "BYTES", [1], ["Hi"]), ("streaming", "BOOL", [1], [True])],
                            outputs=("text_output",),
                            parameters={"triton_enable_empty_final_response": True, "timeout": 2500})
    parsed = parse_request(request, MODEL)
    assert parsed.generation.params == SamplingParams()  # the core's defaults for everything unset
    assert parsed.stream and parsed.empty_final and parsed.reply.outputs == ("text_output",)
    assert parsed.generation.timeout_ms == 3  # tritonclient's timeout is in microseconds


def test_stream_and_streaming_together_are_refused():
    request = infer_request(MODEL, [("text_input", "BYTES", [1], ["Hi"]), ("stream", "BOOL", [1], [True]),
                                    ("streaming", "BOOL", [1], [True])])
    with pytest.raises(errors.InvalidRequest, match="inputs 'stream' and 'streaming' are the same flag"):
        parse_request(request, MODEL)


# --- the RPCs ---

def test_health_and_server_metadata():
    core = FakeCore(WORDS, ready=False)

    async def scenario(stub):
        return (await stub.ServerLive(pb.ServerLiveRequest()), await stub.ServerReady(pb.ServerReadyRequest()),
                await stub.ServerMetadata(pb.ServerMetadataRequest()))

    live, ready, metadata = serve(core, scenario)
    assert live.live and not ready.ready
    assert metadata.name == "disagg" and metadata.version and "model_configuration" in metadata.extensions
    assert kserve.SERVICE_NAME == pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


def test_model_ready_follows_the_core_and_names_an_unknown_model():
    core = FakeCore(WORDS)

    async def scenario(stub):
        ready = await stub.ModelReady(pb.ModelReadyRequest(name=MODEL, version="1"))
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.ModelReady(pb.ModelReadyRequest(name="other"))
        core.available = False
        unavailable = await stub.ModelReady(pb.ModelReadyRequest(name=MODEL))
        with pytest.raises(grpc.aio.AioRpcError) as metadata:
            await stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL))
        return ready, unknown.value, unavailable, metadata.value

    ready, unknown, unavailable, metadata = serve(core, scenario)
    assert ready.ready and not unavailable.ready
    assert unknown.code() == grpc.StatusCode.NOT_FOUND and "model 'other' is not served here" in unknown.details()
    assert metadata.code() == grpc.StatusCode.UNAVAILABLE and "no decode worker" in metadata.details()


def test_model_metadata_and_config_declare_the_llm_tensors_decoupled():
    async def scenario(stub):
        return (await stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL)),
                await stub.ModelConfig(pb.ModelConfigRequest(name=MODEL, version="1")))

    metadata, config = serve(FakeCore(WORDS), scenario)
    inputs = {t.name: (t.datatype, list(t.shape)) for t in metadata.inputs}
    assert metadata.name == MODEL and list(metadata.versions) == ["1"]
    assert inputs["text_input"] == ("BYTES", [1]) and inputs["stream"] == ("BOOL", [1])
    assert inputs["sampling_parameters"] == ("BYTES", [1]) and inputs["max_tokens"] == ("INT32", [1])
    assert inputs["stop"] == ("BYTES", [-1]) and inputs["seed"] == ("UINT64", [1])
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        ("text_output", "BYTES", [-1]), ("finish_reason", "BYTES", [-1])]
    config = config.config
    assert config.model_transaction_policy.decoupled and config.max_batch_size == 0
    text_input = next(i for i in config.input if i.name == "text_input")
    assert text_input.data_type == config_pb.TYPE_STRING and not text_input.optional
    assert all(i.optional for i in config.input if i.name != "text_input")
    assert {o.name: o.data_type for o in config.output} == {"text_output": config_pb.TYPE_STRING,
                                                            "finish_reason": config_pb.TYPE_STRING}


def test_model_infer_answers_the_whole_text_with_the_id_and_the_deadline():
    core = FakeCore(WORDS)

    async def scenario(stub):
        full = await stub.ModelInfer(prompt_request(MODEL, request_id="abc"), timeout=30)
        only_text = await stub.ModelInfer(prompt_request(MODEL, outputs=("text_output",), raw=False))
        return full, only_text

    full, only_text = serve(core, scenario)
    assert outputs_of(full) == {"text_output": "Hello sea", "finish_reason": "length"}
    assert full.id == "abc" and full.model_name == MODEL and full.model_version == "1"
    assert outputs_of(only_text) == {"text_output": "Hello sea"}
    assert 25 < core.timeouts[0] < 31 and core.timeouts[1] is None
    assert core.requests[0].params.temperature == 0 and core.requests[0].params.max_tokens == 8
    assert core.closed == 2


@pytest.mark.parametrize("case", BAD_CASES, ids=[c.name for c in BAD_CASES])
def test_each_bad_request_gets_its_status_and_names_what_is_wrong(case):
    core = FakeCore(WORDS)

    async def scenario(stub):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.ModelInfer(case.build(MODEL))
        return error.value

    error = serve(core, scenario)
    assert error.code() == case.code, error.details()
    assert case.words in error.details()
    assert core.requests == []  # refused before the core saw it, and counted as such
    assert len(core.rejections) == 1 and case.words in str(core.rejections[0])


@pytest.mark.parametrize("exc, code", [
    (errors.ResourceExhausted("the decode queue is full (64 requests)"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.DeadlineExceeded("request passed its deadline of 5 ms"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.InvalidRequest("the prompt has 200 tokens; max_model_len is 128"), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_core_errors_keep_their_status_on_both_rpcs(exc, code):
    core = FakeCore([exc])

    async def scenario(stub):
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.ModelInfer(prompt_request(MODEL))
        call = stub.ModelStreamInfer()
        await call.write(prompt_request(MODEL, stream=True, request_id="s"))
        await call.done_writing()
        return unary.value, [r async for r in call]

    unary, streamed = serve(core, scenario)
    assert unary.code() == code and unary.details() == str(exc)
    assert [(r.error_message, r.infer_response.id) for r in streamed] == [(f"[{code}] {exc}", "s")]
    assert core.rejections == []  # the core counts its own errors


def test_stream_sends_deltas_then_the_finish_flagged_final():
    async def scenario(stub):
        call = stub.ModelStreamInfer()
        await call.write(prompt_request(MODEL, stream=True, request_id="a"))
        await call.done_writing()
        return [r async for r in call]

    responses = serve(FakeCore(WORDS), scenario)
    assert [r.error_message for r in responses] == ["", "", ""]
    replies = [r.infer_response for r in responses]
    assert [outputs_of(r) for r in replies] == [{"text_output": "Hello"}, {"text_output": " sea"},
                                                {"text_output": "", "finish_reason": "length"}]
    assert [final_flag(r) for r in replies] == [False, False, True] and {r.id for r in replies} == {"a"}


def test_empty_final_response_when_asked_and_whole_text_without_stream():
    async def scenario(stub):
        call = stub.ModelStreamInfer()
        await call.write(prompt_request(MODEL, stream=True, request_id="a",
                                        parameters={"triton_enable_empty_final_response": True}))
        await call.done_writing()
        streamed = [r.infer_response async for r in call]
        call = stub.ModelStreamInfer()
        await call.write(prompt_request(MODEL, request_id="b"))
        await call.write(prompt_request(MODEL, request_id="c", parameters={"triton_enable_empty_final_response": True}))
        await call.done_writing()
        return streamed, sorted([r.infer_response async for r in call], key=lambda r: (r.id, final_flag(r)))

    streamed, whole = serve(FakeCore(WORDS), scenario)
    assert [final_flag(r) for r in streamed] == [False, False, False, True]
    assert len(streamed[-1].outputs) == 0 and not streamed[-1].raw_output_contents
    assert [(r.id, outputs_of(r), final_flag(r)) for r in whole] == [
        ("b", {"text_output": "Hello sea", "finish_reason": "length"}, True),
        ("c", {"text_output": "Hello sea", "finish_reason": "length"}, False), ("c", {}, True)]


def test_a_bad_request_on_a_stream_answers_with_its_id_and_the_stream_goes_on():
    cases = [case for case in BAD_CASES if not case.unary_only]
    core = FakeCore(WORDS)

    async def scenario(stub):
        call = stub.ModelStreamInfer()
        for index, case in enumerate(cases):
            request = case.build(MODEL)
            request.id = f"bad-{index}"
            await call.write(request)
        await call.write(prompt_request(MODEL, request_id="good"))
        await call.done_writing()
        return [r async for r in call]

    responses = serve(core, scenario)
    errors_by_id = {r.infer_response.id: r.error_message for r in responses if r.error_message}
    assert len(errors_by_id) == len(cases) >= 15
    for index, case in enumerate(cases):
        assert errors_by_id[f"bad-{index}"].startswith(f"[{case.code}] ") and case.words in errors_by_id[f"bad-{index}"]
    assert len(core.rejections) == len(cases)
    good = [r.infer_response for r in responses if r.infer_response.id == "good"]
    assert [outputs_of(r)["text_output"] for r in good] == ["Hello sea"]


def test_requests_on_one_stream_run_concurrently_and_closing_it_cancels_them():
    core = FakeCore([TextDelta((1,), "x"), HANG])

    async def scenario(stub):
        call = stub.ModelStreamInfer()
        for request_id in ("a", "b", "c"):
            await call.write(prompt_request(MODEL, stream=True, request_id=request_id))
        first = [await call.read() for _ in range(3)]  # one delta each: all three run at once
        call.cancel()
        await core.wait_closed(3)
        return first

    first = serve(core, scenario)
    assert sorted(r.infer_response.id for r in first) == ["a", "b", "c"]
    assert core.closed == 3  # every core stream closed: the router frees their KV


def test_a_client_leaving_a_unary_infer_closes_the_core_stream():
    core = FakeCore([TextDelta((1,), "x"), HANG])

    async def scenario(stub):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.ModelInfer(prompt_request(MODEL), timeout=0.3)
        await core.wait_closed()
        return error.value

    assert serve(core, scenario).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert core.closed == 1

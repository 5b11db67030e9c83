"""KServe v2 requests for the tests of the KServe front door: a builder in tritonclient's raw format (or the
typed contents), and the bad requests each test sends, with the status and the words the answer must have."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Callable

import grpc

from common.pb.inference import grpc_service_pb2 as pb

_PACK = {"BOOL": "?", "INT32": "i", "INT64": "q", "UINT64": "Q", "FP32": "f", "FP64": "d"}
_CONTENTS = {"BOOL": "bool_contents", "INT32": "int_contents", "INT64": "int64_contents",
             "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
             "BYTES": "bytes_contents"}

Input = tuple[str, str, list[int], list]  # name, datatype, shape, flat values (str is UTF-8 encoded for BYTES)


def _bytes(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def raw_of(datatype: str, values: list) -> bytes:
    """Triton's raw format, written here independently of the code under test."""
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(_bytes(v))) + _bytes(v) for v in values)
    return struct.pack(f"<{len(values)}{_PACK[datatype]}", *values)


def infer_request(model: str, inputs: list[Input], *, raw: bool = True, request_id: str = "",
                  outputs: tuple[str, ...] = (), version: str = "", parameters: dict | None = None,
                  ) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, datatype, shape, values in inputs:
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        if raw:
            request.raw_input_contents.append(raw_of(datatype, values))
        else:
            field = getattr(tensor.contents, _CONTENTS[datatype])
            field.extend([_bytes(v) for v in values] if datatype == "BYTES" else values)
    for name in outputs:
        request.outputs.add(name=name)
    for key, value in (parameters or {}).items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        else:
            request.parameters[key].int64_param = value
    return request


def prompt_request(model: str, prompt: str = "The sea is", max_tokens: int = 8, *, stream: bool = False,
                   request_id: str = "", extra: list[Input] = (), **kwargs) -> pb.ModelInferRequest:
    """A greedy request as Triton's vLLM-backend clients send it."""
    sampling = json.dumps({"temperature": 0, "max_tokens": max_tokens})
    inputs = [("text_input", "BYTES", [1], [prompt]), ("stream", "BOOL", [1], [stream]),
              ("sampling_parameters", "BYTES", [1], [sampling]), *extra]
    return infer_request(model, inputs, request_id=request_id, **kwargs)


@dataclass(frozen=True)
class BadCase:
    name: str
    build: Callable[[str], pb.ModelInferRequest]  # model name -> the request
    code: grpc.StatusCode
    words: str  # the answer's message contains these
    unary_only: bool = False  # a request ModelStreamInfer would accept


def _prompt_with(*inputs: Input, sampling: dict | None = None) -> Callable[[str], pb.ModelInferRequest]:
    base = [("text_input", "BYTES", [1], ["Hi"])]
    if sampling is not None:
        base.append(("sampling_parameters", "BYTES", [1], [json.dumps(sampling)]))
    return lambda model: infer_request(model, [*base, *inputs])


def _raw_count_mismatch(model: str) -> pb.ModelInferRequest:
    request = _prompt_with(("max_tokens", "INT32", [1], [4]))(model)
    del request.raw_input_contents[1]
    return request


def _contents_and_raw(model: str) -> pb.ModelInferRequest:
    request = _prompt_with()(model)
    request.inputs[0].contents.bytes_contents.append(b"Hi")
    return request


def _truncated_prefix(model: str) -> pb.ModelInferRequest:
    request = _prompt_with()(model)
    request.raw_input_contents[0] = b"\x02\x00"
    return request


INVALID = grpc.StatusCode.INVALID_ARGUMENT
BAD_CASES = [
    BadCase("unknown model", lambda m: prompt_request("no-such-model"), grpc.StatusCode.NOT_FOUND,
            "model 'no-such-model' is not served here"),
    BadCase("unknown version", lambda m: prompt_request(m, version="7"), grpc.StatusCode.NOT_FOUND,
            "has no version '7'"),
    BadCase("no text_input", lambda m: infer_request(m, [("max_tokens", "INT32", [1], [4])]), INVALID,
            "input 'text_input' is required"),
    BadCase("unknown input", _prompt_with(("prompt", "BYTES", [1], ["x"])), INVALID,
            "input 'prompt' is not an input of model"),
    BadCase("text_input as INT32", lambda m: infer_request(m, [("text_input", "INT32", [1], [3])]), INVALID,
            "input 'text_input' has datatype INT32; it takes BYTES"),
    BadCase("a batch of two prompts", lambda m: infer_request(m, [("text_input", "BYTES", [2], ["a", "b"])]),
            INVALID, "input 'text_input' has shape [2]"),
    BadCase("prompt not UTF-8", lambda m: infer_request(m, [("text_input", "BYTES", [1], [b"\xff\xfe"])]),
            INVALID, "input 'text_input' is not valid UTF-8"),
    BadCase("empty prompt", lambda m: infer_request(m, [("text_input", "BYTES", [1], [""])]), INVALID,
            "input 'text_input' is empty"),
    BadCase("sampling_parameters not JSON", _prompt_with(("sampling_parameters", "BYTES", [1], ["{temp"])),
            INVALID, "input 'sampling_parameters' is not valid JSON"),
    BadCase("sampling_parameters a list", _prompt_with(("sampling_parameters", "BYTES", [1], ["[1]"])),
            INVALID, "input 'sampling_parameters' must be a JSON object"),
    BadCase("unknown sampling key", _prompt_with(sampling={"best_of": 2}), INVALID,
            "input 'sampling_parameters' has unknown key 'best_of'"),
    BadCase("temperature not a number", _prompt_with(sampling={"temperature": "hot"}), INVALID,
            "key 'temperature' must be a number"),
    BadCase("top_p out of range", _prompt_with(sampling={"top_p": 2}), INVALID,
            "key 'top_p': top_p must be in (0, 1]"),
    BadCase("presence_penalty out of range", _prompt_with(sampling={"presence_penalty": 3}), INVALID,
            "key 'presence_penalty': presence_penalty must be in [-2, 2]"),
    BadCase("logit_bias oversized", _prompt_with(sampling={"logit_bias": {str(i): 1 for i in range(301)}}), INVALID,
            "logit_bias has 301 entries; at most 300 are accepted"),
    BadCase("negative temperature input", _prompt_with(("temperature", "FP32", [1], [-1.0])), INVALID,
            "input 'temperature': temperature must be >= 0"),
    BadCase("max_tokens 0", _prompt_with(("max_tokens", "INT32", [1], [0])), INVALID,
            "input 'max_tokens': max_tokens must be >= 1"),
    BadCase("max_tokens given twice", _prompt_with(("max_tokens", "INT32", [1], [4]), sampling={"max_tokens": 3}),
            INVALID, "max_tokens is given twice"),
    BadCase("seed past int64", _prompt_with(("seed", "UINT64", [1], [2**63])), INVALID,
            "input 'seed': seed must be in [0, 2^63)"),
    BadCase("empty stop string", _prompt_with(("stop", "BYTES", [1], [""])), INVALID,
            "input 'stop': stop strings must not be empty"),
    BadCase("65 stop strings", _prompt_with(("stop", "BYTES", [65], ["x"] * 65)), INVALID,
            "input 'stop': stop has 65 strings; at most 64 are accepted"),
    BadCase("stream as BYTES", _prompt_with(("stream", "BYTES", [1], ["yes"])), INVALID,
            "input 'stream' has datatype BYTES; it takes BOOL"),
    BadCase("input given twice", _prompt_with(("top_k", "INT32", [1], [2]), ("top_k", "INT32", [1], [3])),
            INVALID, "input 'top_k' is given twice"),
    BadCase("raw contents for fewer inputs", _raw_count_mismatch, INVALID,
            "raw_input_contents has 1 entries for 2 inputs"),
    BadCase("contents and raw both", _contents_and_raw, INVALID,
            "input 'text_input': has both contents and raw_input_contents"),
    BadCase("raw BYTES cut in a length prefix", _truncated_prefix, INVALID,
            "input 'text_input': raw BYTES content ends inside an element's 4-byte length prefix"),
    BadCase("unknown requested output", lambda m: prompt_request(m, outputs=("logits",)), INVALID,
            "requested output 'logits' is not an output of model"),
    BadCase("sequence batching", lambda m: prompt_request(m, parameters={"sequence_id": 5}), INVALID,
            "parameter 'sequence_id': sequence batching is not supported"),
    BadCase("stream on ModelInfer", lambda m: prompt_request(m, stream=True), INVALID,
            "input 'stream' is true, but ModelInfer sends one response", unary_only=True),
]

"""Structured output at the doors: OpenAI's response_format and vLLM's guided_* fields, KServe's sampling_parameters
keys and our proto's SamplingParams.structured all become the same StructuredOutput, and a bad one is a 400 /
INVALID_ARGUMENT naming the field."""
from __future__ import annotations

import json

import pytest

from common.engine.request import SamplingParams
from common.engine.structured import StructuredOutput
from common.errors import InvalidRequest
from common.pb.disagg.v1 import common_pb2
from services.kit.convert import sampling_from_proto, sampling_to_proto
from services.router.frontends.kserve_request import parse_request
from services.router.frontends.openai_fields import BadField, Fields
from services.router.frontends.openai_requests import parse_chat, parse_completion
from services.router.generation import ServedModel
from tests.kserve_cases import infer_request

SERVED = ServedModel("m", 2048)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _chat(**body) -> SamplingParams:
    return parse_chat(Fields({**CHAT, **body}), "r", SERVED).generation.params


@pytest.mark.parametrize("body, expected", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     StructuredOutput.json_schema(SCHEMA)),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, StructuredOutput.json_schema(SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput.json_schema(SCHEMA)),
    ({"guided_regex": "[a-z]+"}, StructuredOutput("regex", "[a-z]+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutput.choice(["yes", "no"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutput("grammar", 'root ::= "a"')),
])
def test_openai_fields_become_structured_output(body, expected):
    assert _chat(**body).structured == expected
    prompt = {"prompt": "hi", **body}
    assert parse_completion(Fields(prompt), "r", SERVED).generation.params.structured == expected


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format", "type is text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format",
     "'response_format.json_schema.schema' must be a JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strng"}}}}, "response_format",
     "type must be one of"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_choice": "yes"}, "guided_choice", "must be an array of strings"),
    ({"guided_choice": []}, "guided_choice", "non-empty array"),
    ({"guided_regex": 5}, "guided_regex", "must be a string"),
    ({"guided_regex": "a", "guided_json": SCHEMA}, "guided_regex", "cannot be combined with 'guided_json'"),
])
def test_a_bad_structured_field_is_refused_by_name(body, param, words):
    with pytest.raises(BadField, match=words) as caught:
        _chat(**body)
    assert caught.value.param == param


def test_kserve_sampling_parameters_take_the_same_keys():
    def request(sampling: dict):
        inputs = [("text_input", "BYTES", [1], ["hi"]), ("sampling_parameters", "BYTES", [1], [json.dumps(sampling)])]
        return parse_request(infer_request("m", inputs), "m").generation.params

    fmt = json.dumps({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
    assert request({"max_tokens": 5, "response_format": fmt}).structured == StructuredOutput.json_schema(SCHEMA)
    assert request({"guided_choice": ["a", "b"]}).structured == StructuredOutput.choice(["a", "b"])
    with pytest.raises(InvalidRequest, match="input 'sampling_parameters' key 'guided_regex' must be a string"):
        request({"guided_regex": 3})


@pytest.mark.parametrize("structured", [
    StructuredOutput.json_schema(SCHEMA), StructuredOutput("json_object"), StructuredOutput("regex", "[0-9]+"),
    StructuredOutput.choice(["a \"quoted\" one", "b"]), StructuredOutput("grammar", 'root ::= "x"'),
    StructuredOutput("structural_tag", json.dumps({"type": "structural_tag", "format": {"type": "any_text"}})),
])
def test_the_proto_carries_structured_output_both_ways(structured):
    params = SamplingParams(temperature=0, structured=structured)
    sampling, stop, output = sampling_to_proto(params)
    wire = common_pb2.SamplingParams.FromString(sampling.SerializeToString())
    assert sampling_from_proto(wire, stop, output).structured == structured


def test_a_bad_proto_spec_is_invalid_naming_the_field():
    with pytest.raises(InvalidRequest, match=r"sampling.structured.choice must be a non-empty array"):
        sampling_from_proto(common_pb2.SamplingParams(structured=common_pb2.StructuredOutput(
            choice=common_pb2.StructuredOutput.Choice())))
    with pytest.raises(InvalidRequest, match="sampling.structured.json_object must be true"):
        sampling_from_proto(common_pb2.SamplingParams(structured=common_pb2.StructuredOutput(json_object=False)))

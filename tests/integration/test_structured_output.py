"""Structured output through `disagg up`, prefill→decode and aggregated, with clients none of us wrote: the openai
SDK's response_format and vLLM's guided_* extras, LangChain's with_structured_output, KServe's sampling_parameters.
The output validates against its schema (the `jsonschema` package); a schema neither grammar backend can compile is a
400 naming it, and the next request is served. The clusters run `--structured-output-backend auto`; one more,
prefill→decode with `guidance`, runs the SDK and LangChain checks and the constraint sweep again on llguidance (and
its forced tool calls, structural tags, on xgrammar, the fallback), which its workers' metrics confirm."""
from __future__ import annotations

import json
import re
import urllib.request
from typing import Iterator

import jsonschema
import openai
import pytest

from tests.integration.front_doors import Cluster, run_cluster
from tests.integration.leaks import assert_no_leaks
from tests.integration.test_kserve import needs_tritonclient, run_tritonclient
from tests.integration.test_tool_calls import TOOLS, TRIP

# Every string bounded: a random-weight model must still close the object within max_tokens.
BOUNDED = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                            "colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                            "n": {"type": "integer", "minimum": 0, "maximum": 99}},
           "required": ["ok", "colour", "n"], "additionalProperties": False}
PERSON = {"title": "Person", "description": "Someone, by name and age.", "type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
UNCOMPILABLE = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_output_validates_in_every_mode(front_doors: Cluster):
    sdk = front_doors.sdk()
    answer = sdk.chat.completions.create(
        model=front_doors.model, messages=[{"role": "user", "content": "Pick a colour."}], max_tokens=60,
        temperature=0, response_format=_json_schema(BOUNDED))
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), BOUNDED)
    streamed = sdk.chat.completions.create(
        model=front_doors.model, messages=[{"role": "user", "content": "Pick a colour."}], max_tokens=60,
        temperature=0, response_format=_json_schema(BOUNDED), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer.choices[0].message.content


def test_guided_extras_and_sampling_keep_to_the_grammar(front_doors: Cluster):
    sdk = front_doors.sdk()
    choice = sdk.completions.create(model=front_doors.model, prompt="Yes or no?", max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": ["yes", "no", "perhaps"]})
    assert choice.choices[0].text in ("yes", "no", "perhaps")
    for seed in range(3):
        code = sdk.completions.create(model=front_doors.model, prompt="A code:", max_tokens=12, temperature=1.0,
                                      seed=seed, extra_body={"guided_regex": "[A-Z]{3}-[0-9]{4}"})
        assert re.fullmatch("[A-Z]{3}-[0-9]{4}", code.choices[0].text)
    anything = sdk.chat.completions.create(model=front_doors.model, messages=[{"role": "user", "content": "JSON"}],
                                           max_tokens=12, temperature=0, response_format={"type": "json_object"})
    text = anything.choices[0].message.content
    assert text.startswith("{")  # an object, cut short by max_tokens unless the model closed it
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_an_uncompilable_schema_is_a_400_and_the_next_request_is_served(front_doors: Cluster):
    sdk = front_doors.sdk()
    with pytest.raises(openai.BadRequestError, match=r"json_schema cannot be compiled: .*missing") as caught:
        sdk.chat.completions.create(model=front_doors.model, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=8, response_format=_json_schema(UNCOMPILABLE))
    assert caught.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="type must be one of") as caught:
        sdk.chat.completions.create(model=front_doors.model, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=8, response_format=_json_schema({"type": "strng"}))
    assert caught.value.body["param"] == "response_format"
    served = sdk.completions.create(model=front_doors.model, prompt="A code:", max_tokens=8, temperature=0,
                                    extra_body={"guided_regex": "[0-9]{2}"})
    assert re.fullmatch("[0-9]{2}", served.choices[0].text)
    assert_no_leaks(front_doors.workers)


@needs_tritonclient
def test_tritonclient_sends_structured_output_in_sampling_parameters(front_doors: Cluster):
    schema = json.dumps(_json_schema(BOUNDED))
    answers = run_tritonclient("sampled", url=front_doors.router, model=front_doors.model, prompt="Pick one:",
                               samplings=[{"temperature": 0, "max_tokens": 60, "response_format": schema},
                                          {"temperature": 0, "max_tokens": 8, "guided_choice": ["on", "off"]},
                                          {"max_tokens": 8, "guided_regex": "a("}])
    assert answers[0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(answers[0]["text"]), BOUNDED)
    assert answers[1]["text"] in ("on", "off")
    assert answers[2]["status"] == "StatusCode.INVALID_ARGUMENT" and "regex cannot be compiled" in answers[2]["message"]


@pytest.mark.slow
def test_smollm2_fills_a_schema_through_the_sdk_and_langchain(smollm2: Cluster):
    from langchain_openai import ChatOpenAI

    answer = smollm2.sdk().chat.completions.create(
        model=smollm2.model, max_tokens=80, temperature=0, response_format=_json_schema(PERSON),
        messages=[{"role": "user", "content": "Invent a person: their name and age."}])
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    llm = ChatOpenAI(model=smollm2.model, base_url=f"{smollm2.http}/v1", api_key="unused", temperature=0,
                     max_tokens=80, max_retries=0)
    person = llm.with_structured_output(PERSON, method="json_schema").invoke("Alice is 30 years old. Who is she?")
    jsonschema.validate(person, PERSON)


GRAMMAR_EBNF = 'root ::= "ab" [0-9] [0-9]?'
PLAN_TRIP = TOOLS[:1]  # plan_trip alone: a required call must be that one
# What each constraint kind adds to a chat request.
SWEEP = {
    "json_schema": {"response_format": _json_schema(BOUNDED)},
    "json_object": {"response_format": {"type": "json_object"}},
    "regex": {"extra_body": {"guided_regex": "[A-Z]{3}-[0-9]{4}"}},
    "choice": {"extra_body": {"guided_choice": ["yes", "no", "perhaps"]}},
    "grammar": {"extra_body": {"guided_grammar": GRAMMAR_EBNF}},
    "tools_required": {"tools": PLAN_TRIP, "tool_choice": "required", "parallel_tool_calls": False},
    "tools_named": {"tools": PLAN_TRIP, "tool_choice": {"type": "function", "function": {"name": "plan_trip"}}},
}


def _choices(sdk: openai.OpenAI, model: str, stream: bool, **request) -> dict[int, tuple[str, str, list]]:
    """Each choice's (finish_reason, content, [(name, arguments)] of its tool calls), whole or assembled from chunks."""
    if not stream:
        answer = sdk.chat.completions.create(model=model, **request)
        return {c.index: (c.finish_reason, c.message.content or "",
                          [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []])
                for c in answer.choices}
    parts: dict[int, list] = {}
    for chunk in sdk.chat.completions.create(model=model, stream=True, **request):
        for c in chunk.choices:
            reason, text, calls = parts.setdefault(c.index, [None, "", {}])
            parts[c.index][1] = text + (c.delta.content or "")
            for call in c.delta.tool_calls or []:
                name, arguments = calls.get(call.index, (None, ""))
                calls[call.index] = (call.function.name or name, arguments + (call.function.arguments or ""))
            parts[c.index][0] = c.finish_reason or reason
    return {i: (reason, text, [calls[k] for k in sorted(calls)]) for i, (reason, text, calls) in parts.items()}


def _check(kind: str, reason: str, text: str, calls: list) -> None:
    where = (kind, reason, text, calls)
    if kind.startswith("tools"):
        (name, arguments), = calls
        assert name == "plan_trip", where
        jsonschema.validate(json.loads(arguments), TRIP)
        return
    if kind == "json_object":  # any object: a random model may still be writing one at max_tokens
        assert text.startswith("{") and (reason == "length" or isinstance(json.loads(text), dict)), where
        return
    assert reason == "stop", where
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), BOUNDED)
    elif kind == "regex":
        assert re.fullmatch("[A-Z]{3}-[0-9]{4}", text), where
    elif kind == "choice":
        assert text in ("yes", "no", "perhaps"), where
    else:
        assert re.fullmatch("ab[0-9][0-9]?", text), where


@pytest.mark.parametrize("kind", list(SWEEP))
def test_every_constraint_holds_from_the_first_token_sampled_or_not_n_1_or_3_streamed_or_not(front_doors: Cluster,
                                                                                             kind):
    """prefill-decode (every prompt prefilled remotely: the first token is the prefill worker's) and aggregated
    (prefilled where it decodes): every choice keeps to its constraint; a server fault would be a 5xx, a client
    error a 4xx, and neither may come back."""
    sdk = front_doors.sdk()
    for temperature in (0.0, 0.8):
        for n in (1, 3):
            for stream in (False, True):
                choices = _choices(sdk, front_doors.model, stream, n=n, temperature=temperature, seed=5,
                                   max_tokens=60, messages=[{"role": "user", "content": "Answer, please."}],
                                   **SWEEP[kind])
                assert sorted(choices) == list(range(n))
                for reason, text, calls in choices.values():
                    _check(kind, reason, text, calls)
    assert_no_leaks(front_doors.workers)


@pytest.fixture(scope="module")
def guidance_doors(front_door_model) -> Iterator[Cluster]:
    """`disagg up --structured-output-backend guidance`, prefill→decode (the first token from the prefill worker)."""
    yield from run_cluster(front_door_model, "prefill-decode", "--structured-output-backend", "guidance")


@pytest.mark.parametrize("check", [test_json_schema_output_validates_in_every_mode,
                                   test_guided_extras_and_sampling_keep_to_the_grammar,
                                   test_an_uncompilable_schema_is_a_400_and_the_next_request_is_served],
                         ids=lambda check: check.__name__.removeprefix("test_"))
def test_the_sdk_s_structured_output_holds_on_guidance(guidance_doors: Cluster, check):
    check(guidance_doors)


def test_langchain_s_structured_output_and_forced_tools_hold_on_guidance(guidance_doors: Cluster):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=guidance_doors.model, base_url=f"{guidance_doors.http}/v1", api_key="unused",
                     temperature=0, max_tokens=60, max_retries=0)
    colour = {"title": "Colour", "description": "A colour, picked.", **BOUNDED}
    jsonschema.validate(llm.with_structured_output(colour, method="json_schema").invoke("Pick a colour."), BOUNDED)
    asked = llm.bind_tools(PLAN_TRIP, tool_choice="required").invoke("Plan a trip for me.")
    (call,) = asked.tool_calls
    assert call["name"] == "plan_trip", asked
    jsonschema.validate(call["args"], TRIP)


def test_every_constraint_holds_from_the_first_token_on_guidance(guidance_doors: Cluster):
    """The sweep's kinds, each sampled with n 3 and greedy streamed, prefilled remotely; then the workers' metrics:
    llguidance compiled the grammars, xgrammar the forced calls' structural tags, and none was refused."""
    sdk = guidance_doors.sdk()
    for kind in SWEEP:
        for temperature, n, stream in ((0.8, 3, False), (0.0, 1, True)):
            choices = _choices(sdk, guidance_doors.model, stream, n=n, temperature=temperature, seed=5,
                               max_tokens=60, messages=[{"role": "user", "content": "Answer, please."}], **SWEEP[kind])
            assert sorted(choices) == list(range(n))
            for reason, text, calls in choices.values():
                _check(kind, reason, text, calls)
    compiles = {}
    for name, url in guidance_doors.up.metrics_urls().items():
        if name.startswith(("prefill", "decode")):
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            for backend, outcome, value in re.findall(
                    r'^disagg_grammar_compiles_total\{.*?backend="(\w+)".*?outcome="(\w+)".*?\} (\S+)$', text, re.M):
                compiles[backend, outcome] = compiles.get((backend, outcome), 0) + float(value)
    assert compiles.get(("guidance", "compiled"), 0) > 0 and compiles.get(("xgrammar", "compiled"), 0) > 0, compiles
    assert_no_leaks(guidance_doors.workers)

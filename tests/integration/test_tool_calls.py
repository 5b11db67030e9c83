"""Tool calls through `disagg up`, prefill→decode and aggregated, with clients none of us wrote: the openai SDK
(whole and streamed `tool_calls` deltas) and LangChain's bind_tools. A required or named choice is forced by the
grammar, so even a random-weight model returns a call whose arguments validate against the tool's schema (the
`jsonschema` package); SmolLM2, whose chat template has no tools, gets them in Hermes form and answers in it."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.integration.front_doors import Cluster
from tests.integration.leaks import assert_no_leaks

# Every value bounded: a random-weight model must still close the call within max_tokens.
TRIP = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "plan_trip", "description": "Plan a trip", "parameters": TRIP}},
         {"type": "function", "function": {"name": "stay_home", "description": "Stay at home",
                                           "parameters": {"type": "object", "properties": {},
                                                          "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "Plan a trip for me."}]


def _ask(front_doors: Cluster, **request):
    return front_doors.sdk().chat.completions.create(model=front_doors.model, messages=ASK, tools=TOOLS,
                                                     max_tokens=60, temperature=0, **request)


def test_a_required_call_is_valid_whole_and_streams_as_tool_call_deltas(front_doors: Cluster):
    answer = _ask(front_doors, tool_choice="required", parallel_tool_calls=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, next(t for t in TOOLS if t["function"]["name"] == call.function.name)
                        ["function"]["parameters"])
    chunks = list(_ask(front_doors, tool_choice="required", parallel_tool_calls=False, stream=True))
    deltas = [entry for c in chunks if c.choices for entry in c.choices[0].delta.tool_calls or []]
    assert deltas[0].index == 0 and deltas[0].id and deltas[0].function.name == call.function.name
    assert len(deltas) > 1 and all(d.index == 0 and not d.id for d in deltas[1:])  # then argument pieces
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_named_choice_calls_that_function_and_an_unknown_name_is_a_400_then_the_next_is_served(
        front_doors: Cluster):
    named = _ask(front_doors, tool_choice={"type": "function", "function": {"name": "plan_trip"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "plan_trip"
    jsonschema.validate(json.loads(call.function.arguments), TRIP)
    with pytest.raises(openai.BadRequestError, match="'launch', which is not among the tools") as caught:
        _ask(front_doors, tool_choice={"type": "function", "function": {"name": "launch"}})
    assert caught.value.status_code == 400 and caught.value.body["param"] == "tool_choice"
    again = _ask(front_doors, tool_choice="required", parallel_tool_calls=False)
    assert again.choices[0].finish_reason == "tool_calls"
    assert_no_leaks(front_doors.workers)


@pytest.mark.slow
def test_smollm2_calls_a_tool_through_langchain_and_answers_from_its_result(smollm2: Cluster):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "18 C and sunny"

    llm = ChatOpenAI(model=smollm2.model, base_url=f"{smollm2.http}/v1", api_key="unused", temperature=0,
                     max_tokens=60, max_retries=0)
    question = HumanMessage("What is the weather in Paris?")
    for choice in ("get_weather", "required"):
        asked = llm.bind_tools([get_weather], tool_choice=choice).invoke([question])
        assert len(asked.tool_calls) == 1, asked
        (call,) = asked.tool_calls
        assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str), asked
    answered = llm.bind_tools([get_weather]).invoke(
        [question, asked, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])])
    assert isinstance(answered.content, str) and answered.response_metadata["finish_reason"] in ("stop", "length")

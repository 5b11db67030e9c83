"""Tool calls and reasoning on the OpenAI door over a fake core: what reaches the core (messages with calls and
results, tools, the forced call's grammar), the answer's tool_calls and reasoning_content whole and streamed, a
template without tools, and the 400s that name the field."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from common.engine.default_model import default_model_dir
from common.engine.structured import STRUCTURAL_TAG
from services.router.frontends.openai import make_app
from services.router.frontends.openai_tools import ChatParsing
from services.router.generation import (ChatMessage, Finished, FinishReason, GenerationRequest, ServedModel,
                                        TextDelta, Tool, ToolCall, Usage)
from services.router.prepare import RequestPreparer
from services.router.tool_parsers.defaults import template_tools
from tests.fake_core import FakeCore

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
ASKED = {"model": "tiny", "tools": [WEATHER, ADD], "messages": [{"role": "user", "content": "Weather in Paris?"}]}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _script(*texts: str) -> list:
    return [TextDelta((i,), t) for i, t in enumerate(texts)] + [Finished(FinishReason.STOP, Usage(5, len(texts)))]


def _post(core: FakeCore, body: dict, chat: ChatParsing = ChatParsing(), path: str = "/v1/chat/completions"):
    """(status, JSON) of a whole answer, or (status, [chunks]) of a streamed one."""
    async def main():
        async with TestClient(TestServer(make_app(core, 1 << 20, chat=chat))) as client:
            async with client.post(path, json=body) as response:
                if not body.get("stream") or response.status != 200:
                    return response.status, await response.json()
                blocks = (await response.text()).split("\n\n")[:-1]
                return response.status, [json.loads(b[6:]) for b in blocks if b != "data: [DONE]"]
    return asyncio.run(main())


def test_calls_and_results_reach_the_core_and_a_call_in_the_answer_comes_back_as_tool_calls():
    core = FakeCore(_script("<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n',
                            "</tool_call>"))
    status, body = _post(core, {**ASKED, "messages": HISTORY})
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    (request,) = core.requests
    assert request.messages == (
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
        ChatMessage("tool", "18 C, sunny", tool_call_id="call_1"))
    assert [t.name for t in request.tools] == ["get_weather", "add"]
    assert json.loads(request.tools[0].parameters) == WEATHER["function"]["parameters"]
    assert request.params.structured is None  # auto: the model chooses


def test_streamed_calls_arrive_as_deltas_with_index_then_id_and_name_then_argument_pieces():
    core = FakeCore(_script("Let me check.", "\n<tool", '_call>\n{"name": "get_weather", "arguments": {"ci',
                            'ty": "Paris"}}\n</tool_call>'))
    status, chunks = _post(core, {**ASKED, "stream": True})
    assert status == 200
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    calls = [entry for d in deltas for entry in d.get("tool_calls", [])]
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather" and len(calls) > 1
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("choice, forced", [("required", ["get_weather", "add"]),
                                            ({"type": "function", "function": {"name": "add"}}, ["add"])])
def test_a_required_or_named_choice_sends_the_grammar_that_forces_the_call(choice, forced):
    core = FakeCore(_script('<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'))
    status, body = _post(core, {**ASKED, "tool_choice": choice})
    assert status == 200 and body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "add"
    structured = core.requests[0].params.structured
    assert structured.kind == STRUCTURAL_TAG
    form = json.loads(structured.spec)["format"]
    assert [t["begin"].split('"')[3] for t in form["tags"]] == forced and form["stop_after_first"]  # one call


def test_required_allows_several_calls_only_when_the_request_says_parallel_tool_calls():
    core = FakeCore(_script(CALL + CALL))
    status, body = _post(core, {**ASKED, "tool_choice": "required", "parallel_tool_calls": True})
    assert len(body["choices"][0]["message"]["tool_calls"]) == 2
    assert not json.loads(core.requests[0].params.structured.spec)["format"]["stop_after_first"]


def test_choice_none_reads_no_calls_and_functions_are_read_as_tools():
    status, body = _post(FakeCore(_script(CALL)), {**ASKED, "tool_choice": "none"})
    assert body["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": CALL}, "logprobs": None,
                                  "finish_reason": "stop"}
    core = FakeCore(_script(CALL))
    status, body = _post(core, {"messages": ASKED["messages"], "functions": [WEATHER["function"]],
                                "function_call": {"name": "get_weather"}})
    assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls"
    assert [t.name for t in core.requests[0].tools] == ["get_weather"] and core.requests[0].params.structured


BAD = [
    ({**ASKED, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice",
     "names the function 'launch', which is not among the tools (offered: add, get_weather)"),
    ({"messages": ASKED["messages"], "tool_choice": "required"}, "tool_choice", "offers no tools"),
    ({**ASKED, "tool_choice": "always"}, "tool_choice", "must be 'none', 'auto', 'required' or"),
    ({**ASKED, "tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name",
     "letters, digits"),
    ({**ASKED, "tools": [WEATHER, WEATHER]}, "tools", "names a function twice"),
    ({**ASKED, "tools": [{"type": "retrieval"}]}, "tools[0].type", "must be 'function'"),
    ({**ASKED, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with response_format"),
    ({**ASKED, "messages": [{"role": "tool", "content": "18 C"}]}, "messages[0].tool_call_id", "is required"),
    ({**ASKED, "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls[0].function", "is required"),
]


@pytest.mark.parametrize("body, param, words", BAD, ids=[b[1] + "-" + b[2][:20] for b in BAD])
def test_bad_tool_requests_are_400_naming_the_field(body, param, words):
    core = FakeCore(_script("x"))
    status, answer = _post(core, body)
    assert status == 400 and answer["error"]["param"] == param and words in answer["error"]["message"], answer
    assert not core.requests


def test_completions_refuse_tools_by_name():
    status, answer = _post(FakeCore(_script("x")), {"prompt": "hi", "tools": [WEATHER]}, path="/v1/completions")
    assert status == 400 and answer["error"]["param"] == "tools"


def test_a_template_without_tools_gets_them_written_into_the_messages():
    core = FakeCore(_script("It is sunny."))
    status, _ = _post(core, {**ASKED, "messages": [{"role": "system", "content": "Be brief."}, *HISTORY]},
                      chat=ChatParsing("hermes", template_takes_tools=False))
    assert status == 200
    request = core.requests[0]
    assert request.tools == ()
    system, user, assistant, result = request.messages
    assert system.role == "system" and system.content.startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER["function"]["parameters"]) in system.content and "<tool_call>" in system.content
    assert user == ChatMessage("user", "Weather in Paris?")
    assert assistant == ChatMessage("assistant", CALL)
    assert result == ChatMessage("user", "<tool_response>\n18 C, sunny\n</tool_response>")


def test_reasoning_is_split_off_whole_and_streamed_and_calls_are_read_after_it():
    chat = ChatParsing("hermes", reasoning_parser="qwen3")
    script = _script("<think>\nParis is", " in France.</th", "ink>\n\n", CALL)
    status, body = _post(FakeCore(script), ASKED, chat=chat)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "Paris is in France." and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    status, chunks = _post(FakeCore(script), {**ASKED, "stream": True}, chat=chat)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas).strip() == "Paris is in France."
    assert not any(d.get("content") for d in deltas) and any(d.get("tool_calls") for d in deltas)
    status, body = _post(FakeCore(_script("<think>Hm.</think>Hi!")), {"messages": ASKED["messages"]}, chat=chat)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi!", "reasoning_content": "Hm."}


QWEN_LIKE = """{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}{% for call in m.tool_calls or [] %}<tool_call>{{ call.function.arguments | tojson }}</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}<|im_start|>assistant
"""


def test_the_chat_template_gets_tools_and_calls_with_their_arguments_as_objects():
    preparer = RequestPreparer.from_model_dir(default_model_dir())
    preparer.tokenizer.hf.chat_template = QWEN_LIKE
    messages = (ChatMessage("user", "Weather?"),
                ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "get_weather", '{"city": "Paris"}'),)),
                ChatMessage("tool", "18 C", tool_call_id="c1"))
    tool = Tool("get_weather", "The weather", json.dumps(WEATHER["function"]["parameters"]))
    prepared = preparer.prepare(GenerationRequest("r", messages=messages, tools=(tool,)), ServedModel("m", 2048))
    text = preparer.tokenizer.decode(prepared.prompt, skip_special_tokens=False)
    assert '"name": "get_weather"' in text and '"required": ["city"]' in text
    assert '<tool_call>{"city": "Paris"}</tool_call>' in text and "<|im_start|>tool\n18 C" in text


def test_the_default_parser_follows_the_chat_template(tmp_path):
    smollm2 = template_tools(default_model_dir())
    assert (smollm2.takes_tools, smollm2.parser) == (False, "hermes")  # no tools in SmolLM2's template
    from services.router.config import RouterConfig
    from services.router.frontends.openai import _chat_parsing

    router = RouterConfig(model=str(default_model_dir()), reasoning_parser="qwen3")
    assert _chat_parsing(router.model, router.tool_call_parser, router.reasoning_parser) == ChatParsing(
        "hermes", "qwen3", template_takes_tools=False)
    (tmp_path / "chat_template.jinja").write_text("{% if tools %}...{% endif %}<tool_call>")
    assert template_tools(tmp_path).parser == "hermes" and template_tools(tmp_path).takes_tools
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "x"}, {"name": "tool_use", "template": "{{ tools }}[TOOL_CALLS]"}]}))
    assert template_tools(tmp_path).parser == "mistral"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ tools }}"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert template_tools(tmp_path).parser == "llama3_json"


def test_disagg_up_passes_both_parsers_to_the_router_which_checks_their_names():
    import argparse

    from common.errors import InvalidConfig
    from services.cli.up import parse_args, plan, router_argv
    from services.router.config import RouterConfig, add_router_args

    args = parse_args(["--model", "/m", "--prefill", "1", "--decode", "1", "--tool-call-parser", "mistral",
                       "--reasoning-parser", "qwen3"])
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    router, _ = parser.parse_known_args(router_argv(args, plan(args), {"prefill": "h:1", "decode": "h:2"}, 0))
    assert (router.tool_call_parser, router.reasoning_parser) == ("mistral", "qwen3")
    empty = parser.parse_args(["--tool-call-parser", "", "--reasoning-parser", ""])  # compose's unset variables
    assert (empty.tool_call_parser, empty.reasoning_parser) == (None, None)
    with pytest.raises(SystemExit):  # an unknown name is refused at parse time
        parser.parse_args(["--tool-call-parser", "pythonic"])
    with pytest.raises(InvalidConfig, match="--tool-call-parser must be one of"):
        RouterConfig(model="/m", tool_call_parser="pythonic")


def test_tools_too_large_to_force_are_a_400_naming_tools():
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(800)}}
    tools = [{"type": "function", "function": {"name": "big", "parameters": huge}}]
    core = FakeCore(_script("x"))
    status, answer = _post(core, {**ASKED, "tools": tools, "tool_choice": "required"})
    assert status == 400 and answer["error"]["param"] == "tools" and "at most 65536" in answer["error"]["message"]


def test_legacy_function_call_and_function_messages_become_a_call_and_its_result():
    core = FakeCore(_script("Sunny."))
    status, _ = _post(core, {"functions": [WEATHER["function"]], "messages": [
        ASKED["messages"][0],
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"city": "X"}'}},
        {"role": "function", "name": "get_weather", "content": "18 C"}]})
    assert status == 200
    _, asked, result = core.requests[0].messages
    assert [(c.name, c.arguments) for c in asked.tool_calls] == [("get_weather", '{"city": "X"}')]
    assert result == ChatMessage("tool", "18 C", name="get_weather")


def test_tools_past_the_context_are_refused_before_the_template_renders_them():
    from common.errors import InvalidRequest

    preparer = RequestPreparer.from_model_dir(default_model_dir())
    tool = Tool("get_weather", "x" * 1_000_000)
    with pytest.raises(InvalidRequest, match="the prompt has 1000002 characters"):
        preparer.prepare(GenerationRequest("r", messages=(ChatMessage("user", "Hi"),), tools=(tool,)),
                         ServedModel("m", 2048))

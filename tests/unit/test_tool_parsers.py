"""Tool-call parsers (Hermes, Llama 3 JSON, Mistral): whole answers, the same answers streamed in any chunking, text
that only looks like a call, and the structural tag each writes for a forced call, compiled by xgrammar."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.router import tool_parsers
from services.router.generation import Tool, ToolCall
from services.router.tool_parsers.stream import CallStart

NAMES = frozenset({"get_weather", "add"})
WEATHER = '{"city": "Paris", "unit": "celsius"}'
TRICKY = '{"a": [1, {"b": "} ] \\" {"}], "c": null}'  # braces and quotes inside strings

# (parser, answer, content, [(name, arguments)])
CASES = [
    ("hermes", "The sea is <b>blue</b> and 3 < 4.", "The sea is <b>blue</b> and 3 < 4.", []),
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', None,
     [("get_weather", WEATHER)]),
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
               f'<tool_call>\n{{"arguments": {TRICKY}, "name": "add"}}\n</tool_call>', "Let me look.",
     [("get_weather", WEATHER), ("add", TRICKY)]),
    ("hermes", '<tool_call>{"name": "add", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("add", '{"x": 1}')]),
    ("hermes", '<tool_call>{"name": "add"}</tool_call>', None, [("add", "{}")]),
    ("hermes", '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "launch", "arguments": {}}</tool_call>', []),  # not among the tools
    ("hermes", "<tool_call> maybe later", "<tool_call> maybe later", []),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"x": oops}}</tool_call>',
     '<tool_call>{"name": "add", "arguments": {"x": oops}}</tool_call>', []),  # its JSON does not parse
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', None, [("get_weather", WEATHER)]),
    ("llama3_json", f'<|python_tag|>{{"name": "add", "parameters": {TRICKY}}}; '
                    f'{{"name": "get_weather", "parameters": {WEATHER}}}', None,
     [("add", TRICKY), ("get_weather", WEATHER)]),
    ("llama3_json", ' {"answer": 42} is JSON', ' {"answer": 42} is JSON', []),
    ("llama3_json", 'Call {"name": "add", "parameters": {}}', 'Call {"name": "add", "parameters": {}}', []),
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
                f'{{"name": "add", "arguments": {TRICKY}}}]', None, [("get_weather", WEATHER), ("add", TRICKY)]),
    ("mistral", f'[{{"name": "add", "arguments": {TRICKY}}}]', None, [("add", TRICKY)]),
    ("mistral", "[1, 2] are numbers", "[1, 2] are numbers", []),
]


def _ids(case) -> str:
    return f"{case[0]}-{case[1][:30]}"


@pytest.mark.parametrize("parser, answer, content, calls", CASES, ids=map(_ids, CASES))
def test_a_whole_answer_parses_into_content_and_calls(parser, answer, content, calls):
    got_content, got_calls = tool_parsers.get(parser).parse(answer, NAMES)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(json.loads(c.arguments) is not None and c.id.startswith("call_") for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


def _streamed(parser: str, chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    stream = tool_parsers.get(parser).stream(NAMES)
    outputs = [stream.feed(chunk) for chunk in chunks] + [stream.finish()]
    content = "".join(o.content for o in outputs)
    calls: dict[int, list[str]] = {}
    for delta in (d for o in outputs for d in o.calls):
        if isinstance(delta, CallStart):
            assert delta.index == len(calls)  # each call starts once, in order, before its arguments
            calls[delta.index] = [delta.name, ""]
        else:
            calls[delta.index][1] += delta.text
    return content, [tuple(c) for c in calls.values()]


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from([c for c in CASES if "oops" not in c[1]]), cuts=st.lists(st.integers(0, 200)))
def test_a_streamed_answer_gives_the_same_content_and_calls_however_it_is_chunked(case, cuts):
    parser, answer, content, calls = case
    points = sorted({min(c, len(answer)) for c in cuts} | {0, len(answer)})
    chunks = [answer[a:b] for a, b in zip(points, points[1:])]
    streamed_content, streamed_calls = _streamed(parser, chunks)
    assert streamed_calls == calls
    assert streamed_content == (content or "") if not calls else streamed_content.strip() == (content or "")


def test_arguments_stream_piece_by_piece_after_the_name_and_text_before_a_call_is_not_held():
    stream = tool_parsers.get("hermes").stream(NAMES)
    first = stream.feed("Sure. <tool_")
    assert first.content == "Sure." and not first.calls  # "<tool_" may open a call: held back
    named = stream.feed('call>{"name": "get_weather", "arguments": {"ci')
    assert [type(d).__name__ for d in named.calls] == ["CallStart", "CallArguments"]
    assert named.calls[0].name == "get_weather" and named.calls[1].text == '{"ci' and not named.content
    rest = stream.feed('ty": "Paris"}}</tool_call>')
    assert "".join(d.text for d in rest.calls) == 'ty": "Paris"}' and not rest.content


def test_a_call_cut_short_keeps_what_was_written_of_its_arguments_whole_and_streamed():
    answer = '<tool_call>{"name": "add", "arguments": {}}</tool_call>\n<tool_call>{"name": "add", "arguments": {"x": 1'
    assert _streamed("hermes", [answer]) == ("", [("add", "{}"), ("add", '{"x": 1')])
    content, calls = tool_parsers.get("hermes").parse(answer, NAMES)
    assert content is None and [c.arguments for c in calls] == ["{}", '{"x": 1']


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
          "required": ["city"], "additionalProperties": False}
TOOLS = (Tool("get_weather", "The weather in a city", json.dumps(SCHEMA)), Tool("add"))


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_a_forced_call_grammar_accepts_the_format_with_valid_arguments_only(parser):
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    tools = tool_parsers.get(parser)
    one = Grammar.from_structural_tag(tools.constraint(TOOLS, parallel=False))
    many = Grammar.from_structural_tag(tools.constraint(TOOLS, parallel=True))
    paris = ToolCall("1", "get_weather", '{"city": "Paris"}')
    london = ToolCall("2", "get_weather", '{"city": "London"}')
    add = ToolCall("3", "add", '{"x": [1, 2]}')
    assert accepts(one, tools.render_calls((paris,))) and accepts(one, tools.render_calls((add,)))
    assert not accepts(one, tools.render_calls((london,)))  # not in the schema's enum
    assert not accepts(one, tools.render_calls((paris, add))) and accepts(many, tools.render_calls((paris, add)))
    assert not accepts(one, "It is sunny.") and not accepts(one, "")
    content, calls = tools.parse(tools.render_calls((paris, add)), NAMES)  # what the grammar lets out, read back
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"x": [1, 2]})]


def test_the_registry_names_each_format_and_refuses_an_unknown_one():
    from common.errors import InvalidConfig

    assert set(tool_parsers.names()) >= {"hermes", "llama3_json", "mistral"}
    with pytest.raises(InvalidConfig, match="--tool-call-parser must be one of"):
        tool_parsers.get("pythonic")


PIECES = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{", "}", "[", "]", ",", ":", ";", " ",
          "\n", '"name"', '"arguments"', '"parameters"', '"add"', '"get_weather"', '"x"', "1", "null", '"\\""',
          "<", "a"]


@settings(max_examples=150, deadline=None)
@given(parser=st.sampled_from(["hermes", "llama3_json", "mistral"]), pieces=st.lists(st.sampled_from(PIECES)),
       cuts=st.lists(st.integers(0, 80)))
def test_any_text_streams_the_same_in_any_chunking_as_in_one_piece(parser, pieces, cuts):
    answer = "".join(pieces)
    points = sorted({min(c, len(answer)) for c in cuts} | {0, len(answer)})
    whole = _streamed(parser, [answer])
    assert _streamed(parser, [answer[a:b] for a, b in zip(points, points[1:])]) == whole
    content, calls = tool_parsers.get(parser).parse(answer, NAMES)
    if not calls:
        assert content == answer


@pytest.mark.parametrize("reasoning, opening", [("qwen3", "<think>"), ("deepseek_r1", "")])
def test_a_forced_call_after_reasoning_lets_the_reasoning_come_first(reasoning, opening):
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from services.router import reasoning_parsers

    hermes = tool_parsers.get("hermes")
    before = reasoning_parsers.get(reasoning).constraint_prefix()
    grammar = Grammar.from_structural_tag(hermes.constraint(TOOLS, parallel=False, before=before))
    call = hermes.render_calls((ToolCall("1", "get_weather", '{"city": "Tokyo"}'),))
    assert accepts(grammar, f"{opening}Tokyo, then.</think>\n\n{call}")
    assert not accepts(grammar, call) and not accepts(grammar, f"{opening}Tokyo, then.</think>\n\nIt rains.")

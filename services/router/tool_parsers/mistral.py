"""Mistral: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`. `[TOOL_CALLS]` is a special
token that decoding drops, so an answer that opens with `[` is read as the array. (Mistral's v11 tokenizer form,
`[TOOL_CALLS]name[ARGS]{...}`, is not read.)"""
from __future__ import annotations

import json

from services.router.generation import Tool, ToolCall
from services.router.tool_parsers.base import ToolCallParser, arguments_text
from services.router.tool_parsers.stream import CallSyntax

_MARKER = "[TOOL_CALLS]"


class Mistral(ToolCallParser):
    name = "mistral"
    syntax = CallSyntax(markers=(_MARKER,), bare_opener="[", array=True)
    calls_begin = _MARKER + "["
    calls_end = "]"
    separator = ", "
    call_end = "}"

    def call_begin(self, name: str) -> str:
        return f'{{"name": "{name}", "arguments": '

    def tools_prompt(self, tools: tuple[Tool, ...]) -> str:
        signatures = json.dumps([t.template_dict() for t in tools], ensure_ascii=False)
        return (f"[AVAILABLE_TOOLS]{signatures}[/AVAILABLE_TOOLS]\nTo call functions, answer with {_MARKER} and a "
                f'JSON array of calls: {_MARKER}[{{"name": <function-name>, "arguments": <args-json-object>}}]')

    def render_calls(self, calls: tuple[ToolCall, ...]) -> str:
        items = ", ".join(f'{{"name": "{c.name}", "arguments": {arguments_text(c)}}}' for c in calls)
        return f"{_MARKER}[{items}]"


PARSER = Mistral()

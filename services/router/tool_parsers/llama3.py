"""Llama 3.1 / 3.2 JSON calls: the answer is `{"name": ..., "parameters": {...}}` (several separated by `;`),
optionally after `<|python_tag|>` (a special token that decoding drops, so an answer that opens with `{` is read as
one). Its prompt text is Llama 3.1's JSON tool-calling prompt."""
from __future__ import annotations

import json

from services.router.generation import Tool, ToolCall
from services.router.tool_parsers.base import ToolCallParser, arguments_text
from services.router.tool_parsers.stream import CallSyntax


class Llama3Json(ToolCallParser):
    name = "llama3_json"
    syntax = CallSyntax(markers=("<|python_tag|>",), bare_opener="{", separator=";")
    separator = "; "
    call_end = "}"

    def call_begin(self, name: str) -> str:
        return f'{{"name": "{name}", "parameters": '

    def tools_prompt(self, tools: tuple[Tool, ...]) -> str:
        signatures = "\n\n".join(json.dumps(t.template_dict(), indent=4, ensure_ascii=False) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
                f"value}}. Do not use variables.\n\n{signatures}")

    def render_calls(self, calls: tuple[ToolCall, ...]) -> str:
        return "; ".join(f'{{"name": "{c.name}", "parameters": {arguments_text(c)}}}' for c in calls)


PARSER = Llama3Json()

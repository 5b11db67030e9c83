"""Hermes / Qwen 2.5 / Qwen 3: each call a JSON object between `<tool_call>` and `</tool_call>`,
`{"name": ..., "arguments": {...}}`, after any text. Its prompt text is Qwen 2.5's chat template's."""
from __future__ import annotations

from services.router.generation import ChatMessage, Tool, ToolCall
from services.router.tool_parsers.base import ToolCallParser, arguments_text, tool_json
from services.router.tool_parsers.stream import CallSyntax

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ToolCallParser):
    name = "hermes"
    syntax = CallSyntax(markers=(_OPEN,), end=_CLOSE)
    separator = "\n"
    call_end = "}\n" + _CLOSE

    def call_begin(self, name: str) -> str:
        return f'{_OPEN}\n{{"name": "{name}", "arguments": '

    def tools_prompt(self, tools: tuple[Tool, ...]) -> str:
        signatures = "\n".join(map(tool_json, tools))
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                f"{signatures}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                f'{_OPEN}{_CLOSE} XML tags:\n{_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}'
                f"\n{_CLOSE}")

    def render_calls(self, calls: tuple[ToolCall, ...]) -> str:
        return "\n".join(f'{_OPEN}\n{{"name": "{c.name}", "arguments": {arguments_text(c)}}}\n{_CLOSE}'
                         for c in calls)

    def render_result(self, message: ChatMessage) -> str:
        return f"<tool_response>\n{message.content}\n</tool_response>"


PARSER = Hermes()

"""A tool-call format: how a model family writes its calls (read back by stream.py's machine), how a request's
required or named call is forced (an xgrammar structural tag, which the workers apply as a token mask), and how
tools, calls and results are written into a prompt whose chat template knows no tools (render.py)."""
from __future__ import annotations

import json
from typing import Any

from services.router.generation import ChatMessage, Tool, ToolCall
from services.router.tool_parsers.stream import CallStream, CallSyntax, parse_calls

# The longest run of whitespace a forced call's arguments may hold (one: `{"a": 1}` reads as models write it, and a
# small model cannot fill max_tokens with blank lines before the first key).
MAX_WHITESPACE_RUN = 1


class ToolCallParser:
    """The base of every format: a subclass sets its syntax and the text around one forced call."""

    name = ""
    syntax = CallSyntax(markers=())
    calls_begin = ""  # before the forced calls (Mistral's "[TOOL_CALLS][")
    calls_end = ""
    separator = "\n"  # between two forced calls
    call_end = "}"  # after a forced call's arguments

    def call_begin(self, name: str) -> str:
        """A forced call's text up to its arguments (the name is fixed by then)."""
        raise NotImplementedError

    def stream(self, tool_names: frozenset[str]) -> CallStream:
        return CallStream(self.syntax, tool_names)

    def parse(self, text: str, tool_names: frozenset[str]) -> tuple[str | None, tuple[ToolCall, ...]]:
        return parse_calls(self.syntax, text, tool_names)

    def constraint(self, tools: tuple[Tool, ...], parallel: bool, before: tuple[dict[str, Any], ...] = ()) -> str:
        """An xgrammar structural tag (JSON) for an answer that is one or more calls (one unless `parallel`) of
        `tools`, each with arguments valid against its schema; `before`: formats the calls follow (reasoning)."""
        tags = [{"type": "tag", "begin": self.call_begin(tool.name), "end": self.call_end,
                 "content": {"type": "json_schema", "json_schema": _schema(tool),
                             "max_whitespace_cnt": MAX_WHITESPACE_RUN}} for tool in tools]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": self.separator, "at_least_one": True,
                 "stop_after_first": not parallel}
        elements = [*before, *_const(self.calls_begin), calls, *_const(self.calls_end)]
        form = elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}
        return json.dumps({"type": "structural_tag", "format": form}, ensure_ascii=False)

    # Prompts whose chat template has no tools (render.py).

    def tools_prompt(self, tools: tuple[Tool, ...]) -> str:
        raise NotImplementedError

    def render_calls(self, calls: tuple[ToolCall, ...]) -> str:
        raise NotImplementedError

    def render_result(self, message: ChatMessage) -> str:
        return message.content


def _schema(tool: Tool) -> dict[str, Any]:
    """A tool's arguments schema; with none given, any object (a call's arguments are an object)."""
    return json.loads(tool.parameters) if tool.parameters else {"type": "object"}


def _const(text: str) -> list[dict[str, Any]]:
    return [{"type": "const_string", "value": text}] if text else []


def tool_json(tool: Tool) -> str:
    return json.dumps(tool.template_dict(), ensure_ascii=False)


def arguments_text(call: ToolCall) -> str:
    """A call's arguments as JSON text in a prompt (what the model wrote, if it parses; else as a string)."""
    try:
        json.loads(call.arguments)
    except json.JSONDecodeError:
        return json.dumps(call.arguments, ensure_ascii=False)
    return call.arguments

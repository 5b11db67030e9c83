"""A chat answer's text → OpenAI's message fields: `reasoning_content` (with --reasoning-parser), `content`, and
`tool_calls` (when the request offered tools and did not choose none), whole or as stream deltas. Reasoning is read
first; tool calls are read in the content after it. With neither, the text is the content, unchanged."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.router import reasoning_parsers, tool_parsers
from services.router.frontends.openai_tools import NONE, ChatParsing, ToolRequest
from services.router.generation import ToolCall
from services.router.reasoning_parsers.think import ThinkParser
from services.router.tool_parsers.base import ToolCallParser
from services.router.tool_parsers.stream import CallStart, Output

Json = dict[str, Any]


@dataclass(frozen=True)
class OutputParsing:
    """How one request's answer is read."""

    reasoning: ThinkParser | None = None
    tools: ToolCallParser | None = None  # None: no tool calls are read
    tool_names: frozenset[str] = frozenset()

    @classmethod
    def of(cls, chat: ChatParsing, tools: ToolRequest | None) -> OutputParsing:
        reasoning = reasoning_parsers.get(chat.reasoning_parser) if chat.reasoning_parser else None
        if tools is None or tools.choice == NONE:
            return cls(reasoning)
        return cls(reasoning, tool_parsers.get(chat.tool_call_parser), tools.names)


class ChatOutput:
    """One choice's answer; `called` once it holds a tool call (its finish reason is then tool_calls)."""

    def __init__(self, parsing: OutputParsing):
        self._parsing = parsing
        self._reasoning = parsing.reasoning.stream() if parsing.reasoning else None
        self._calls = parsing.tools.stream(parsing.tool_names) if parsing.tools else None
        self.called = False

    def delta(self, text: str) -> Json:
        """The delta fields this text completes (none while a tag or a call's start is being held back)."""
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._fields(reasoning, self._calls.feed(content) if self._calls else Output(content))

    def finish(self) -> Json:
        """The delta fields held back until the answer ended."""
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        if self._calls is None:
            return self._fields(reasoning, Output(content))
        calls = self._calls.feed(content)
        last = self._calls.finish()
        return self._fields(reasoning, Output(calls.content + last.content, calls.calls + last.calls))

    def message(self, text: str) -> Json:
        """The whole answer's message."""
        parsing = self._parsing
        reasoning, content = parsing.reasoning.parse(text) if parsing.reasoning else (None, text)
        calls: tuple[ToolCall, ...] = ()
        if parsing.tools is not None:
            content, calls = parsing.tools.parse(content, parsing.tool_names)
        message: Json = {"role": "assistant", "content": content}
        if calls:
            self.called = True
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        if parsing.reasoning is not None:
            message["reasoning_content"] = reasoning
        return message

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.called and reason == "stop" else reason

    def _fields(self, reasoning: str, output: Output) -> Json:
        fields: Json = {}
        if reasoning:
            fields["reasoning_content"] = reasoning
        if output.content:
            fields["content"] = output.content
        if output.calls:
            self.called = True
            fields["tool_calls"] = _call_deltas(output)
        return fields


def _call_deltas(output: Output) -> list[Json]:
    """OpenAI's `delta.tool_calls`: a call's first entry has its id, type and name; the others add to its
    arguments. Entries of one call that follow each other are joined."""
    entries: list[Json] = []
    for delta in output.calls:
        if isinstance(delta, CallStart):
            entries.append({"index": delta.index, "id": delta.id, "type": "function",
                            "function": {"name": delta.name, "arguments": ""}})
        elif entries and entries[-1]["index"] == delta.index:
            entries[-1]["function"]["arguments"] += delta.text
        else:
            entries.append({"index": delta.index, "function": {"arguments": delta.text}})
    return entries

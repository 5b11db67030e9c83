"""Tool calling on the OpenAI door, request side: `tools`, `tool_choice`, `parallel_tool_calls` (and the legacy
`functions` / `function_call`, mapped onto them), assistant messages with `tool_calls` and `tool` messages; how
they reach the chat template (or the messages, for a template without tools: tool_parsers/render.py), and the
constraint that forces a required or named call. The answer side is openai_chat_output.py."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Callable

from common.engine.request import SamplingParams
from common.engine.structured import STRUCTURAL_TAG, StructuredOutput
from common.errors import InvalidRequest
from services.router import reasoning_parsers, tool_parsers
from services.router.frontends.openai_fields import BadField, Fields
from services.router.generation import ChatMessage, Tool, ToolCall
from services.router.tool_parsers.defaults import FALLBACK_PARSER, template_tools
from services.router.tool_parsers.render import without_template_tools
from services.router.tool_parsers.stream import new_call_id

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule; it also keeps a name safe inside a grammar's literal
NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "function"


@dataclass(frozen=True)
class ChatParsing:
    """The door's reading of chat answers (--tool-call-parser, --reasoning-parser) and whether the model's chat
    template renders tools."""

    tool_call_parser: str = FALLBACK_PARSER
    reasoning_parser: str | None = None
    template_takes_tools: bool = True

    @classmethod
    def for_model(cls, model_dir: str, tool_call_parser: str | None, reasoning_parser: str | None) -> ChatParsing:
        """The flags, with the tool-call parser defaulting to the one that fits the model's chat template."""
        facts = template_tools(model_dir)
        return cls(tool_call_parser or facts.parser, reasoning_parser, facts.takes_tools)


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str = AUTO  # NONE, AUTO, REQUIRED or NAMED
    function: str | None = None  # NAMED: the function
    parallel: bool | None = None  # parallel_tool_calls as sent (None: not sent)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    @property
    def forced(self) -> tuple[Tool, ...]:
        """The tools a call must be made to (none unless required or named)."""
        if self.choice == NAMED:
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools if self.choice == REQUIRED else ()


def read_tools(fields: Fields) -> ToolRequest | None:
    """The request's tools and choice; None when it offers none."""
    legacy = fields.body.get("functions") is not None
    if legacy and fields.body.get("tools") is not None:
        raise fields.bad("functions", "cannot be sent with 'tools' (it is their older form)")
    field, choice_field = ("functions", "function_call") if legacy else ("tools", "tool_choice")
    items = fields.array(field) or []
    if len(items) > MAX_TOOLS:
        raise fields.bad(field, f"has {len(items)} tools; at most {MAX_TOOLS} are accepted")
    tools = tuple(_tool(fields, f"{field}[{i}]", item, legacy) for i, item in enumerate(items))
    names = [t.name for t in tools]
    if len(set(names)) < len(names):
        raise fields.bad(field, f"names a function twice: {sorted({n for n in names if names.count(n) > 1})}")
    choice, function = _choice(fields, choice_field, fields.body.get(choice_field), frozenset(names), legacy)
    parallel = fields.boolean("parallel_tool_calls")
    if not tools:
        return None
    return ToolRequest(tools, choice, function, parallel)


def _tool(fields: Fields, where: str, item: object, legacy: bool) -> Tool:
    if not isinstance(item, dict):
        raise fields.bad(where, "must be an object")
    tool = Fields(item, fields.name(where) + ".")
    if not legacy:
        if tool.string("type", required=True) != "function":
            raise tool.bad("type", f"must be 'function', got {item['type']!r}")
        function = tool.object("function")
        if function is None:
            raise tool.bad("function", "is required")
        tool = function
    name = tool.string("name", required=True)
    if not _NAME.fullmatch(name):
        raise tool.bad("name", f"must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
    parameters = tool.object("parameters")
    return Tool(name, tool.string("description") or "", json.dumps(parameters.body) if parameters else "")


def _choice(fields: Fields, field: str, value: object, names: frozenset[str], legacy: bool) -> tuple[str, str | None]:
    if value is None:
        return (AUTO if names else NONE), None
    if value in (NONE, AUTO, REQUIRED) and not (legacy and value == REQUIRED):
        if value == REQUIRED and not names:
            raise fields.bad(field, "is 'required' but the request offers no tools")
        return str(value), None
    named = _named(value, legacy)
    if not isinstance(named, str):
        words = ("'none', 'auto' or " + '{"name": ...}') if legacy else (
            "'none', 'auto', 'required' or " + '{"type": "function", "function": {"name": ...}}')
        raise fields.bad(field, f"must be {words}, got {json.dumps(value)[:200]}")
    if named not in names:
        offered = ", ".join(sorted(names)) or "none"
        raise fields.bad(field, f"names the function {named!r}, which is not among the tools (offered: {offered})")
    return NAMED, named


def _named(value: object, legacy: bool) -> object:
    """The function a tool_choice (or legacy function_call) object names."""
    if not isinstance(value, dict):
        return None
    if legacy:
        return value.get("name")
    function = value.get("function")
    return function.get("name") if value.get("type") == "function" and isinstance(function, dict) else None


def chat_message(message: Fields, role: str, content: Callable[[], str]) -> ChatMessage:
    """One message; an assistant's `tool_calls` (or legacy `function_call`), a tool's `tool_call_id`, a legacy
    function message's `name`. An assistant that calls tools may have null content."""
    if role == "tool":
        legacy = message.body.get("role") == "function"
        call_id = None if legacy else message.string("tool_call_id", required=True)
        return ChatMessage("tool", content(), tool_call_id=call_id, name=message.string("name", required=legacy))
    calls = _calls(message) if role == "assistant" else ()
    if calls and message.body.get("content") is None:
        return ChatMessage(role, "", tool_calls=calls)
    return ChatMessage(role, content(), tool_calls=calls)


def _calls(message: Fields) -> tuple[ToolCall, ...]:
    legacy = message.object("function_call")
    if legacy is not None:
        return (ToolCall(new_call_id(), legacy.string("name", required=True),
                         legacy.string("arguments") or "{}"),)
    calls = []
    for i, item in enumerate(message.array("tool_calls") or []):
        where = f"tool_calls[{i}]"
        if not isinstance(item, dict):
            raise message.bad(where, "must be an object")
        call = Fields(item, message.name(where) + ".")
        function = call.object("function")
        if function is None:
            raise call.bad("function", "is required")
        calls.append(ToolCall(call.string("id") or new_call_id(), function.string("name", required=True),
                              function.string("arguments") or "{}"))
    return tuple(calls)


def for_template(messages: tuple[ChatMessage, ...], tools: ToolRequest | None,
                 chat: ChatParsing) -> tuple[tuple[ChatMessage, ...], tuple[Tool, ...]]:
    """The messages and tools the chat template is given: as they are where it renders tools, else plain messages
    that carry them (render.py)."""
    offered = tools.tools if tools is not None else ()
    if chat.template_takes_tools:
        return messages, offered
    if offered or any(m.tool_calls or m.role == "tool" for m in messages):
        return without_template_tools(messages, offered, tool_parsers.get(chat.tool_call_parser)), ()
    return messages, ()


def tool_constraint(tools: ToolRequest | None, chat: ChatParsing) -> str | None:
    """The structural tag (xgrammar's JSON) that forces a required or named call; None when none is forced. A
    forced answer is one call unless the request sent parallel_tool_calls true with 'required': small models,
    allowed more, repeat their call until max_tokens."""
    if tools is None or not tools.forced:
        return None
    before = reasoning_parsers.get(chat.reasoning_parser).constraint_prefix() if chat.reasoning_parser else ()
    parallel = tools.parallel is True and tools.choice == REQUIRED
    return tool_parsers.get(chat.tool_call_parser).constraint(tools.forced, parallel, before)


def constrain(params: SamplingParams, tools: ToolRequest | None, chat: ChatParsing) -> SamplingParams:
    """The sampling params with the forced call's constraint (a required or named tool_choice)."""
    spec = tool_constraint(tools, chat)
    if spec is None:
        return params
    if params.structured is not None:
        what = "'required'" if tools.choice == REQUIRED else f"naming {tools.function!r}"
        raise BadField("tool_choice", f"'tool_choice' {what} forces a tool call, which cannot be combined with "
                                      "response_format or a guided_* field")
    try:
        structured = StructuredOutput(STRUCTURAL_TAG, spec)
    except InvalidRequest as exc:  # its size limit: the grammar holds every forced tool's schema
        raise BadField("tools", f"'tools' cannot be forced into a call: {exc}") from None
    return replace(params, structured=structured)


def refuse_tools(fields: Fields) -> None:
    """/v1/completions has no messages to carry calls: tools there are refused by name."""
    for field in ("tools", "functions"):
        if fields.body.get(field):
            raise fields.bad(field, "cannot be honoured on /v1/completions: tool calling is for /v1/chat/completions")
    for field in ("tool_choice", "function_call"):
        if fields.body.get(field) not in (None, NONE, AUTO):
            raise fields.bad(field, "cannot be honoured on /v1/completions: tool calling is for "
                                    "/v1/chat/completions")

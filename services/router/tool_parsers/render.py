"""Tools in a prompt whose chat template knows none (SmolLM2's, for one): the messages become plain ones that any
template renders. The tools are described at the end of the system message (one is added first when there is
none); an assistant's calls become its text, written as the tool-call parser reads them; tool results become a
user message (consecutive results one message), as Qwen 2.5's template writes them."""
from __future__ import annotations

from services.router.generation import ChatMessage, Tool
from services.router.tool_parsers.base import ToolCallParser


def without_template_tools(messages: tuple[ChatMessage, ...], tools: tuple[Tool, ...],
                           parser: ToolCallParser) -> tuple[ChatMessage, ...]:
    rendered: list[ChatMessage] = []
    rest = messages
    if tools:
        prompt = parser.tools_prompt(tools)
        if messages and messages[0].role == "system":
            prompt, rest = f"{messages[0].content}\n\n{prompt}", messages[1:]
        rendered.append(ChatMessage("system", prompt))
    results: list[str] = []
    for message in rest:
        if message.role == "tool":
            results.append(parser.render_result(message))
            continue
        if results:
            rendered.append(ChatMessage("user", "\n".join(results)))
            results = []
        if message.tool_calls:
            text = parser.render_calls(message.tool_calls)
            rendered.append(ChatMessage(message.role, f"{message.content}\n{text}" if message.content else text))
        else:
            rendered.append(ChatMessage(message.role, message.content))
    if results:
        rendered.append(ChatMessage("user", "\n".join(results)))
    return tuple(rendered)

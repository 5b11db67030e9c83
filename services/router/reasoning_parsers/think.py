"""`<think>…</think>` reasoning, read out of an answer as it streams: reasoning first, then the content.

DeepSeek-R1's chat template opens `<think>` in the prompt, so its answer starts inside the reasoning (a `<think>`
it writes anyway is dropped); Qwen3 writes both tags, and an answer that does not open with `<think>` is all content.
An answer that ends inside its reasoning (max_tokens) is all reasoning; the whitespace after `</think>` is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_WS = " \t\n\r"


@dataclass(frozen=True)
class ThinkParser:
    name: str
    starts_inside: bool  # the prompt opened the reasoning
    start: str = "<think>"
    end: str = "</think>"

    def stream(self) -> ThinkStream:
        return ThinkStream(self)

    def parse(self, text: str) -> tuple[str | None, str]:
        """A whole answer → (reasoning, stripped; None when there is none, content)."""
        stream = self.stream()
        pieces = [stream.feed(text), stream.finish()]
        reasoning = "".join(r for r, _ in pieces).strip(_WS)
        return (reasoning or None) if stream.reasoned else None, "".join(c for _, c in pieces)

    def constraint_prefix(self) -> tuple[dict[str, Any], ...]:
        """The structural-tag formats of the reasoning that comes before a forced answer (xgrammar's form)."""
        begin = "" if self.starts_inside else self.start
        return ({"type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": self.end},
                {"type": "const_string", "value": "\n\n"})


class ThinkStream:
    def __init__(self, parser: ThinkParser):
        self._parser = parser
        self._state = "start"  # start, reasoning, after (whitespace after the end tag), content
        self._pending = ""
        self.reasoned = False  # the answer had a reasoning part

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that this text completes; what might begin a tag is held until it is known."""
        self._pending += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._state == "start":
            self._open(final)
        if self._state == "reasoning":
            reasoning = self._reason(final)
        if self._state == "after":
            self._pending = self._pending.lstrip(_WS)
            if self._pending:
                self._state = "content"
        if self._state == "content":
            content, self._pending = self._pending, ""
        return reasoning, content

    def _open(self, final: bool) -> None:
        body = self._pending.lstrip(_WS)
        start = self._parser.start
        if body.startswith(start):
            self._pending, self._state = body[len(start):], "reasoning"
        elif start.startswith(body) and not final:
            return  # the answer so far may be the start of the tag
        else:
            self._state = "reasoning" if self._parser.starts_inside else "content"
        self.reasoned = self._state == "reasoning"

    def _reason(self, final: bool) -> str:
        end = self._parser.end
        at = self._pending.find(end)
        if at >= 0:
            reasoning, self._pending, self._state = self._pending[:at], self._pending[at + len(end):], "after"
            return reasoning
        keep = 0 if final else _partial(self._pending, end)
        reasoning, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        return reasoning


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


DEEPSEEK_R1 = ThinkParser("deepseek_r1", starts_inside=True)
QWEN3 = ThinkParser("qwen3", starts_inside=False)

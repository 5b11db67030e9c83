"""Tool calls read out of a model's text as it streams, for any format whose calls are JSON objects with a name and
arguments (Hermes `<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`): a format is a `CallSyntax`.

Text outside calls streams as content, less what might be the start of a call marker (held until it is known);
a call streams as a CallStart once its name is read, then its arguments' text piece by piece as it is written, as
OpenAI streams `tool_calls`. A region that turns out not to be a call (no object, a name not among the request's
tools) goes back to the content. Parsing a whole answer (`parse_calls`) is the same machine fed once, except that a
closed call whose JSON does not parse turns the whole answer back into content, as vLLM does.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Union

from services.router.generation import ToolCall
from services.router.tool_parsers.scan import ObjectScan

_WS = " \t\n\r"


@dataclass(frozen=True)
class CallSyntax:
    markers: tuple[str, ...]  # text that opens a region of calls
    end: str = ""  # text that closes a region ("": the region ends with its JSON)
    bare_opener: str = ""  # a region also opens where the answer starts with this ("{", "["): the marker is a
    # special token that decoding drops
    array: bool = False  # the region holds a JSON array of calls
    separator: str = ""  # between two calls of a region, besides whitespace
    arguments_keys: tuple[str, ...] = ("arguments", "parameters")


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


CallDelta = Union[CallStart, CallArguments]


@dataclass
class Output:
    """What one feed gave: content text and call deltas, in order within each."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class _Call:
    start: CallStart
    sent: int = 0  # characters of the arguments' text sent


class CallStream:
    """One answer's text → content and tool call deltas. `tool_names`: the functions the request offered."""

    def __init__(self, syntax: CallSyntax, tool_names: frozenset[str]):
        self._syntax = syntax
        self._names = tool_names
        self._state = "content"  # content, open, object, after
        self._pending = ""  # text not read yet
        self._region = ""  # the text of the region being read, given back as content if it holds no call
        self._started = False  # content other than whitespace went out (a bare opener counts only before)
        self._held = ""  # trailing whitespace of the content: dropped if a call follows
        self._in_array = False
        self._scan = ObjectScan()
        self._call: _Call | None = None
        self.count = 0  # calls started
        self.failed = False  # a call's JSON did not parse

    def feed(self, text: str) -> Output:
        out = Output()
        self._pending += text
        self._run(out, final=False)
        return out

    def finish(self) -> Output:
        out = Output()
        self._run(out, final=True)  # reads all that is pending, short of a call that never closed
        if self._state == "object" and self._call is not None:
            self._send_arguments(out)  # cut short (max_tokens): what was written of its arguments
        elif self._state in ("open", "object"):
            self._give_back(out)
        if not self.count:
            out.content += self._held
        self._held = ""
        return out

    def _run(self, out: Output, final: bool) -> None:
        step = {"content": self._content, "open": self._open, "object": self._object, "after": self._after}
        while step[self._state](out, final):
            pass

    def _emit(self, out: Output, text: str) -> None:
        """Content, holding back trailing whitespace (between or after calls it is dropped)."""
        body = text.rstrip(_WS)
        if body:
            out.content += self._held + body
            self._held = ""
            self._started = True
        self._held += text[len(body):]

    def _content(self, out: Output, final: bool) -> bool:
        pending = self._pending
        at, marker = _earliest(pending, self._syntax.markers)
        opener = self._syntax.bare_opener
        if opener and not self._started and not self.count:
            body = pending.lstrip(_WS)
            if not final and any(m.startswith(body) for m in self._syntax.markers):
                return False  # only whitespace yet, or what may become a marker ("[" of "[TOOL_CALLS]")
            if body and body[0] == opener and (at is None or len(pending) - len(body) < at):
                self._region, self._pending, self._state = pending[:len(pending) - len(body)], body, "open"
                return True
        if at is not None:
            self._emit(out, pending[:at])
            self._region, self._pending, self._state = marker, pending[at + len(marker):], "open"
            return True
        keep = 0 if final else _partial_marker(pending, self._syntax.markers)
        self._emit(out, pending[:len(pending) - keep])
        self._pending = pending[len(pending) - keep:]
        return False

    def _open(self, out: Output, final: bool) -> bool:
        body = self._pending.lstrip(_WS)
        self._region += self._pending[:len(self._pending) - len(body)]
        self._pending = body
        if not body:
            return False
        if self._syntax.array and not self._in_array:
            if body[0] != "[":
                return self._give_back(out)
            self._in_array, self._region, self._pending = True, self._region + "[", body[1:]
            return True
        if body[0] != "{":
            return self._give_back(out)
        self._call, self._state = None, "object"
        self._scan = ObjectScan()
        return True

    def _object(self, out: Output, final: bool) -> bool:
        scan = self._scan
        taken = scan.push(self._pending)
        self._pending = self._pending[taken:]
        if self._call is None:
            name = scan.string("name")
            if name is None and scan.span("name") is not None and scan.span("name")[1] is not None:
                return self._give_back(out)  # a name that is not a string
            if name is not None:
                if name not in self._names:
                    return self._give_back(out)
                self._call = _Call(CallStart(self.count, new_call_id(), name))
                self.count += 1
                self._held = ""
                out.calls.append(self._call.start)
        if scan.failed or (scan.done and self._call is None):
            if self._call is None:
                return self._give_back(out)
            self.failed = True
        if self._call is not None:
            self._send_arguments(out)
        if scan.done or scan.failed:
            if scan.done and self._call is not None and not _valid(scan, self._syntax.arguments_keys):
                self.failed = True
            self._region, self._call, self._state = "", None, "after" if scan.done else "content"
            return True
        return False

    def _send_arguments(self, out: Output) -> None:
        call, scan = self._call, self._scan
        span = next((s for s in map(scan.span, self._syntax.arguments_keys) if s is not None), None)
        if span is None:
            if scan.done and not call.sent:
                out.calls.append(CallArguments(call.start.index, "{}"))
                call.sent = 2
            return
        start, end = span
        if scan.text[start] == '"':  # arguments sent as a JSON string: its value, once complete
            if end is not None and not call.sent:
                value = json.loads(scan.text[start:end]) if _parses(scan.text[start:end]) else ""
                out.calls.append(CallArguments(call.start.index, value))
                call.sent = end - start
            return
        text = scan.text[start + call.sent:end if end is not None else len(scan.text)]
        if text:
            out.calls.append(CallArguments(call.start.index, text))
            call.sent += len(text)

    def _after(self, out: Output, final: bool) -> bool:
        body = self._pending = self._pending.lstrip(_WS)
        if not body:
            return False
        syntax = self._syntax
        if syntax.array:
            if body[0] == ",":
                self._pending, self._state = body[1:], "open"
            elif body[0] == "]":
                self._in_array, self._pending, self._state = False, body[1:], "content"
            else:
                self._in_array, self._state = False, "content"
            return True
        if syntax.separator and body.startswith(syntax.separator):
            self._pending, self._state = body[len(syntax.separator):], "open"
            return True
        if not syntax.end and body[0] == "{":
            self._pending, self._state = body, "open"
            return True
        if syntax.end and body.startswith(syntax.end):
            self._pending, self._state = body[len(syntax.end):], "content"
            return True
        if syntax.end and syntax.end.startswith(body):
            if final:
                self._pending = ""  # the end marker, cut short
            return False
        self._state = "content"
        return True

    def _give_back(self, out: Output) -> bool:
        """The region holds no call: its text is content after all."""
        text = self._region + (self._scan.text if self._state == "object" else "")
        self._emit(out, text)
        self._started = True
        self._region, self._in_array, self._call, self._state = "", False, None, "content"
        return True


def _earliest(text: str, markers: tuple[str, ...]) -> tuple[int | None, str]:
    found = [(text.find(m), m) for m in markers if m in text]
    return min(found) if found else (None, "")


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins a marker."""
    for size in range(min(len(text), max(map(len, markers), default=0) - 1), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            return size
    return 0


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _valid(scan: ObjectScan, arguments_keys: tuple[str, ...]) -> bool:
    """The call's JSON parses, and its arguments (if any) are an object or a string."""
    try:
        call = json.loads(scan.text)
    except json.JSONDecodeError:
        return False
    arguments = next((call[k] for k in arguments_keys if k in call), {})
    return isinstance(arguments, (dict, str))


def parse_calls(syntax: CallSyntax, text: str, tool_names: frozenset[str]) -> tuple[str | None, tuple[ToolCall, ...]]:
    """A whole answer → (content, calls). With calls, the content is the text around them, stripped (None when
    there is none); an answer with a call whose JSON does not parse is all content. A last call cut short
    (max_tokens) keeps what was written of its arguments, as OpenAI's answers do."""
    stream = CallStream(syntax, tool_names)
    outputs = [stream.feed(text), stream.finish()]
    if stream.failed or not stream.count:
        return text, ()
    names: dict[int, CallStart] = {}
    arguments: dict[int, list[str]] = {}
    for delta in (d for o in outputs for d in o.calls):
        if isinstance(delta, CallStart):
            names[delta.index] = delta
        else:
            arguments.setdefault(delta.index, []).append(delta.text)
    calls = tuple(ToolCall(start.id, start.name, "".join(arguments.get(i, ()))) for i, start in sorted(names.items()))
    content = "".join(o.content for o in outputs).strip()
    return content or None, calls

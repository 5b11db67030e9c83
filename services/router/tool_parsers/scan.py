"""One JSON object read a character at a time, as a model writes it: where each top-level value starts and ends, so
that a tool call's name is known as soon as its string closes and its arguments can stream while they are written.

It follows the object's outline only (keys, colons, commas, nesting); the text is parsed in full (json.loads) once
the object closes.
"""
from __future__ import annotations

import json

_WS = " \t\n\r"


class ObjectScan:
    def __init__(self) -> None:
        self.text = ""
        self.done = False  # the object closed
        self.failed = False  # the text is not a JSON object's outline
        self._values: dict[str, list[int]] = {}  # top-level key -> [start, end] offsets in text; end -1 while open
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "open"  # open, first_key, key, colon, value, string, nested, scalar, after
        self._key_start = 0
        self._key = ""

    def push(self, chunk: str) -> int:
        """Reads `chunk` until the object closes or turns out malformed; returns how many characters it took."""
        base = len(self.text)
        self.text += chunk
        for i, c in enumerate(chunk):
            self._step(c, base + i)
            if self.done or self.failed:
                self.text = self.text[:base + i + 1]
                return i + 1
        return len(chunk)

    def span(self, key: str) -> tuple[int, int | None] | None:
        """Where the top-level value of `key` lies in `text` (end None while it is still being written)."""
        span = self._values.get(key)
        if span is None:
            return None
        return span[0], (None if span[1] < 0 else span[1])

    def string(self, key: str) -> str | None:
        """The value of `key` once it is a complete string; None before, or when it is not a string."""
        span = self.span(key)
        if span is None or span[1] is None or self.text[span[0]] != '"':
            return None
        return _loads(self.text[span[0]:span[1]])

    def _step(self, c: str, pos: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                self._string_closed(pos)
            return
        if self._expect == "scalar" and c in _WS + ",}":
            self._end_value(pos)
            if c in _WS:
                return
        if self._expect == "nested":
            self._nested(c, pos)
        elif c not in _WS:
            self._outline(c, pos)

    def _nested(self, c: str, pos: int) -> None:
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._end_value(pos + 1)

    def _outline(self, c: str, pos: int) -> None:
        expect = self._expect
        if expect == "open" and c == "{":
            self._depth, self._expect = 1, "first_key"
        elif expect in ("first_key", "key") and c == '"':
            self._in_string, self._key_start = True, pos
        elif expect in ("first_key", "after") and c == "}":
            self._depth, self.done = 0, True
        elif expect == "colon" and c == ":":
            self._expect = "value"
        elif expect == "after" and c == ",":
            self._expect = "key"
        elif expect == "value":
            self._values[self._key] = [pos, -1]
            if c == '"':
                self._in_string, self._expect = True, "string"
            elif c in "{[":
                self._depth, self._expect = 2, "nested"
            else:
                self._expect = "scalar"
        elif expect != "scalar":
            self.failed = True

    def _string_closed(self, pos: int) -> None:
        if self._expect in ("first_key", "key"):
            key = _loads(self.text[self._key_start:pos + 1])
            self._key, self._expect = key or "", "colon"
            self.failed = key is None
        elif self._expect == "string":
            self._end_value(pos + 1)

    def _end_value(self, end: int) -> None:
        self._values[self._key][1] = end
        self._expect = "after"


def _loads(string: str) -> str | None:
    """A JSON string's value; None for a bad escape."""
    try:
        return json.loads(string)
    except json.JSONDecodeError:
        return None

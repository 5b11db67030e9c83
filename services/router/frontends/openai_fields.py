"""Reading an OpenAI request body: typed field reads that name the field when it is wrong, and the fields this
server cannot honour (a clear 400 rather than an answer that silently ignores what was asked)."""
from __future__ import annotations

from typing import Any, Callable

from common.errors import InvalidRequest, NotFound

_JSON_TYPE = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
              dict: "an object", type(None): "null"}


class BadField(InvalidRequest):
    """A field with a wrong type or value: 400, with `param` naming it in the error JSON."""

    code = "invalid_value"

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class ModelNotFound(NotFound):
    """`model` names a model this router does not serve: 404 with OpenAI's code."""

    code = "model_not_found"
    param = "model"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not the integer 1


class Fields:
    """One JSON object's fields; a missing field and an explicit null both read as None. `prefix` places nested
    objects in messages (`messages[2].content`)."""

    def __init__(self, body: dict[str, Any], prefix: str = ""):
        self.body = body
        self.prefix = prefix

    def name(self, field: str) -> str:
        return self.prefix + field

    def bad(self, field: str, message: str) -> BadField:
        return BadField(self.name(field), f"'{self.name(field)}' {message}")

    def _read(self, field: str, ok: Callable[[Any], bool], expected: str, required: bool) -> Any:
        value = self.body.get(field)
        if value is None:
            if required:
                raise self.bad(field, "is required")
            return None
        if not ok(value):
            raise self.bad(field, f"must be {expected}, got {_JSON_TYPE.get(type(value), type(value).__name__)}")
        return value

    def integer(self, field: str, minimum: int | None = None, required: bool = False) -> int | None:
        value = self._read(field, _is_int, "an integer", required)
        if value is not None and minimum is not None and value < minimum:
            raise self.bad(field, f"must be >= {minimum}, got {value}")
        return value

    def number(self, field: str) -> float | None:
        value = self._read(field, lambda v: _is_int(v) or isinstance(v, float), "a number", False)
        return None if value is None else float(value)

    def boolean(self, field: str) -> bool | None:
        return self._read(field, lambda v: isinstance(v, bool), "a boolean", False)

    def string(self, field: str, required: bool = False) -> str | None:
        return self._read(field, lambda v: isinstance(v, str), "a string", required)

    def array(self, field: str, required: bool = False) -> list | None:
        return self._read(field, lambda v: isinstance(v, list), "an array", required)

    def object(self, field: str) -> Fields | None:
        value = self._read(field, lambda v: isinstance(v, dict), "an object", False)
        return None if value is None else Fields(value, self.name(field) + ".")

    def strings(self, field: str) -> tuple[str, ...]:
        """A string or an array of strings (OpenAI's `stop`)."""
        value = self.body.get(field)
        if isinstance(value, str):
            return (value,)
        items = self._read(field, lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
                           "a string or an array of strings", False)
        return tuple(items or ())

    def integers(self, field: str) -> tuple[int, ...]:
        items = self._read(field, lambda v: isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v),
                           "an array of non-negative integers", False)
        return tuple(items or ())


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _one_of(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == a and type(value) is type(a) for a in allowed)


# Fields whose only values we can honour are "off": anything else is refused by name. Other unknown fields are
# ignored, since clients send extras.
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (_empty, "insertion (text after the completion) is not supported"),
    "min_tokens": (lambda v: v is None or _one_of(0)(v), "only 0 is supported"),
    "modalities": (lambda v: v is None or v == ["text"], 'only ["text"] output is supported'),
    "audio": (_empty, "audio output is not supported"),
}


def refuse_unsupported(fields: Fields) -> None:
    for field, (honourable, why) in _UNSUPPORTED.items():
        if field in fields.body and not honourable(fields.body[field]):
            raise fields.bad(field, f"cannot be honoured: {why}")

"""Structured output: what a request's text must match, as one of the forms xgrammar compiles (OpenAI's
response_format and vLLM's guided_* extras map onto these).

Torch-free and xgrammar-free (xgrammar imports torch; the router must not): construction checks what can be checked
without the model's tokenizer (a kind we know, JSON that parses, the shape each kind takes, sizes). The worker
compiles it (common.engine.grammar), and what xgrammar refuses there (a schema keyword it lacks, a grammar's syntax,
a regex's) is InvalidRequest as well, before any token is generated: every door answers 400 / INVALID_ARGUMENT.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from common.errors import InvalidRequest

JSON_SCHEMA = "json_schema"  # spec: the schema, as JSON text
JSON_OBJECT = "json_object"  # spec: "" (any JSON object)
REGEX = "regex"  # spec: the regular expression
CHOICE = "choice"  # spec: a JSON array of the strings allowed
GRAMMAR = "grammar"  # spec: EBNF (GBNF), root rule `root`
STRUCTURAL_TAG = "structural_tag"  # spec: an xgrammar structural tag, as JSON text

# The cost of compiling grows with the spec, and compiling happens on the worker: refused up front instead.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024
MAX_JSON_DEPTH = 64
_JSON_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}


def _json(kind: str, spec: str) -> Any:
    try:
        value = json.loads(spec)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequest(f"{kind} is not valid JSON: {exc}") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"{kind} nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def _depth(value: Any) -> int:
    depth, level = 0, [value]
    while level:
        depth += 1
        level = [v for item in level if isinstance(item, (dict, list))
                 for v in (item.values() if isinstance(item, dict) else item)]
    return depth - 1


def _check_schema(spec: str) -> None:
    schema = _json(JSON_SCHEMA, spec)
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(f"json_schema must be a JSON object (or true / false), got {type(schema).__name__}")
    _check_types(schema, "")


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
SCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                "unevaluatedProperties", "unevaluatedItems")


def _check_types(node: Any, where: str) -> None:
    """Each subschema's `type` names JSON types: the mistake clients make most, caught before a worker is asked."""
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    names = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if any(not isinstance(n, str) or n not in _JSON_TYPES for n in names):
        raise InvalidRequest(f"json_schema at '{where or '/'}': type must be one of {', '.join(sorted(_JSON_TYPES))} "
                             f"(or a list of them), got {json.dumps(kind)}")
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _check_types(sub, f"{where}/{key}/{name}")
    for key in SCHEMA_LISTS + SCHEMA_ONES:
        subs = node.get(key)
        for i, sub in enumerate(subs if isinstance(subs, list) else [subs]):
            _check_types(sub, f"{where}/{key}" + (f"/{i}" if isinstance(subs, list) else ""))


def _check_empty(spec: str) -> None:
    if spec:
        raise InvalidRequest("json_object takes no spec (it allows any JSON object)")


def _check_text(kind: str) -> Callable[[str], None]:
    def check(spec: str) -> None:
        if not spec.strip():
            raise InvalidRequest(f"{kind} is empty")
    return check


def _check_choice(spec: str) -> None:
    choices = _json(CHOICE, spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequest("choice must be a non-empty array of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise InvalidRequest(f"choice has {len(choices)} strings; at most {MAX_CHOICES} are accepted")


def _check_tag(spec: str) -> None:
    tag = _json(STRUCTURAL_TAG, spec)
    if not isinstance(tag, dict) or "format" not in tag:
        raise InvalidRequest('structural_tag must be a JSON object with a "format" (xgrammar\'s structural tag)')


_CHECKS: dict[str, Callable[[str], None]] = {
    JSON_SCHEMA: _check_schema, JSON_OBJECT: _check_empty, REGEX: _check_text(REGEX), CHOICE: _check_choice,
    GRAMMAR: _check_text(GRAMMAR), STRUCTURAL_TAG: _check_tag,
}
KINDS = tuple(_CHECKS)


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. Hashable: the worker's compiled-grammar cache is keyed by it."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _CHECKS:
            raise InvalidRequest(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise InvalidRequest(f"{self.kind} must be given as text, got {type(self.spec).__name__}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequest(f"{self.kind} has {len(self.spec)} characters; at most {MAX_SPEC_CHARS} are "
                                 "accepted")
        _CHECKS[self.kind](self.spec)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> StructuredOutput:
        return cls(JSON_SCHEMA, json.dumps(schema))  # key order kept: it is the order the output's keys take

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        return cls(CHOICE, json.dumps(choices))

    def describe(self) -> str:
        """Short words for logs and errors (the spec can be 64 KiB)."""
        return f"{self.kind} ({len(self.spec)} characters)" if self.spec else self.kind

"""Structured output as clients ask for it: OpenAI's `response_format` and vLLM's `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` → common.engine.structured.StructuredOutput. Read by the OpenAI door (request
fields) and the KServe door (`sampling_parameters` keys); every error is a BadField naming the field."""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from common.engine.structured import GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, StructuredOutput
from common.errors import InvalidRequest
from services.router.frontends.openai_fields import BadField

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_output(values: Mapping[str, Any]) -> StructuredOutput | None:
    """From whichever of FIELDS is set (at most one; response_format {"type": "text"} counts as unset). A field
    may also hold its JSON as a string, as KServe's sampling_parameters and vLLM's guided_json send it."""
    given = [(f, values[f]) for f in FIELDS if values.get(f) is not None]
    given = [(f, v) for f, v in given if not (f == "response_format" and _is_text(v))]
    if not given:
        return None
    if len(given) > 1:
        raise BadField(given[1][0], f"'{given[1][0]}' cannot be combined with '{given[0][0]}': give one way to "
                                    "constrain the output")
    field, value = given[0]
    try:
        return _READERS[field](field, value)
    except BadField:
        raise
    except InvalidRequest as exc:  # StructuredOutput's own checks, which start with the kind
        raise BadField(field, f"'{field}': {exc}") from None


def _is_text(value: Any) -> bool:
    return value == {"type": "text"} or value == '{"type": "text"}' or value == "text"


def _parsed(field: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise BadField(field, f"'{field}' is a string that is not valid JSON: {exc}") from None


def _response_format(field: str, value: Any) -> StructuredOutput:
    value = _parsed(field, value)
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == JSON_OBJECT:
        return StructuredOutput(JSON_OBJECT)
    if kind != JSON_SCHEMA:
        raise BadField(field, f"'{field}' must be an object whose type is text, json_object or json_schema, got "
                              f"{json.dumps(value)[:200]}")
    wrapper = value.get(JSON_SCHEMA)
    schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
    if not isinstance(schema, (dict, bool)):
        raise BadField(field, f"'{field}.json_schema.schema' must be a JSON schema (an object); OpenAI's form is "
                              '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}')
    try:
        return StructuredOutput.json_schema(schema)  # strict or not, the schema is enforced
    except InvalidRequest as exc:
        raise BadField(field, f"'{field}.json_schema.schema': {exc}") from None


def _guided_json(field: str, value: Any) -> StructuredOutput:
    schema = _parsed(field, value)
    if not isinstance(schema, (dict, bool)):
        raise BadField(field, f"'{field}' must be a JSON schema (an object, or its JSON text)")
    return StructuredOutput.json_schema(schema)


def _text(kind: str):
    def read(field: str, value: Any) -> StructuredOutput:
        if not isinstance(value, str):
            raise BadField(field, f"'{field}' must be a string")
        return StructuredOutput(kind, value)
    return read


def _guided_choice(field: str, value: Any) -> StructuredOutput:
    choices = _parsed(field, value) if isinstance(value, str) and value.startswith("[") else value
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise BadField(field, f"'{field}' must be an array of strings")
    return StructuredOutput.choice(choices)


_READERS = {"response_format": _response_format, "guided_json": _guided_json, "guided_regex": _text(REGEX),
            "guided_choice": _guided_choice, "guided_grammar": _text(GRAMMAR)}

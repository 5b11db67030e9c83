"""--engine-config FILE.yaml and --engine-overrides JSON: every engine setting in one place, under the command line.

Merged in one place, lowest first, as Dynamo's TensorRT-LLM worker merges its engine arguments: a flag's default
(its DISAGG_* variable included) < the YAML file < the JSON overrides < the flag given on the command line. Keys are
the flag names without `--` (dashes or underscores alike); a switch (no-prefix-caching) takes true or false. An
unknown key or a value of the wrong type is an InvalidConfig of one line that names it.

Which flags were given is noted by the flags' own actions as argparse runs them (`Given`, `GivenSwitch`), so the
parse itself tells, for any spelling argparse accepts (`--flag=v`, an abbreviation), with no second parse.
"""
from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import InvalidConfig

_GIVEN = "_engine_flags_given"  # the namespace attribute: dests of the engine flags given on the command line


class _Noted(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        setattr(namespace, _GIVEN, getattr(namespace, _GIVEN, frozenset()) | {self.dest})


class Given(_Noted, argparse._StoreAction):
    """A valued engine flag that notes it was given."""


class GivenSwitch(_Noted, argparse._StoreTrueAction):
    """A switch engine flag that notes it was given."""


def given(args: argparse.Namespace) -> frozenset[str]:
    """The dests of the engine flags given on the command line."""
    return getattr(args, _GIVEN, frozenset())


@dataclass(frozen=True)
class FlagSpec:
    """What a key may hold: the flag's dest, and its type as argparse would convert it."""

    key: str  # the flag without `--`
    dest: str
    kind: type  # bool (a switch), int, float or str
    choices: tuple | None
    nullable: bool  # None is a value of it (its default is None: "unset")

    def check(self, value: Any, source: str) -> Any:
        if value is None and self.nullable:
            return None
        ok = {bool: isinstance(value, bool),
              int: isinstance(value, int) and not isinstance(value, bool),
              float: isinstance(value, (int, float)) and not isinstance(value, bool),
              str: isinstance(value, str)}[self.kind]
        if not ok:
            names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
            unset = " or null" if self.nullable else ""
            raise InvalidConfig(f"{source}: {self.key} must be {names[self.kind]}{unset}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise InvalidConfig(f"{source}: {self.key} must be one of {list(self.choices)}, got {value!r}")
        return float(value) if self.kind is float else value


def flag_specs(actions: Iterable[argparse.Action]) -> dict[str, FlagSpec]:
    """Each engine flag's spec by key (the flag without `--`)."""
    specs = {}
    for action in actions:
        key = action.option_strings[-1].removeprefix("--")
        kind = bool if isinstance(action, GivenSwitch) else action.type or str
        choices = tuple(action.choices) if action.choices is not None else None
        specs[key] = FlagSpec(key, action.dest, kind, choices, action.default is None and kind is not bool)
    return specs


def read_yaml(path: str) -> dict[str, Any]:
    source = f"--engine-config {path}"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidConfig(f"{source}: cannot read it ({exc.strerror or exc})") from None
    import yaml  # only a process given a file pays for the import

    try:
        layer = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise InvalidConfig(f"{source}: not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    return _mapping(layer, source, "a YAML file")


def read_json(text: str, flag: str = "--engine-overrides") -> dict[str, Any]:
    try:
        layer = json.loads(text)
    except ValueError as exc:
        raise InvalidConfig(f"{flag}: not valid JSON: {exc}") from None
    return _mapping(layer, flag, "JSON")


def _mapping(layer: Any, source: str, what: str) -> dict[str, Any]:
    if layer is None:  # an empty file
        return {}
    if not isinstance(layer, dict):
        raise InvalidConfig(f"{source}: {what} of `flag: value` pairs is expected, got a {type(layer).__name__}")
    return layer


def checked(layer: Mapping[str, Any], specs: Mapping[str, FlagSpec], source: str) -> dict[str, Any]:
    """The layer's values by dest, each checked against its flag; one line naming the first bad key."""
    out = {}
    for raw, value in layer.items():
        key = str(raw).replace("_", "-")
        spec = specs.get(key)
        if spec is None:
            close = difflib.get_close_matches(key, list(specs), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise InvalidConfig(f"{source}: unknown key '{raw}'{hint}; keys are the engine flags without --")
        out[spec.dest] = spec.check(value, source)
    return out


def apply_layers(args: argparse.Namespace, layers: Iterable[tuple[str, Mapping[str, Any]]],
                 specs: Mapping[str, FlagSpec]) -> None:
    """Set on `args`, in order (a later layer wins), every layer's values for the flags not given on the command
    line. Idempotent: applying the same layers again changes nothing."""
    explicit = given(args)
    for source, layer in layers:
        for dest, value in checked(layer, specs, source).items():
            if dest not in explicit:
                setattr(args, dest, value)

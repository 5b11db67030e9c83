"""Tool-call parsers by name (`--tool-call-parser`): each reads one model family's calls out of its answers and
forces a required or named call (base.py). A new format is its module and one `register` line here; one kept outside
the project is a module that calls `register`, named in DISAGG_TOOL_CALL_PARSER_MODULES (comma separated)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from common.errors import InvalidConfig
from services.router.registry import Registry

if TYPE_CHECKING:
    from services.router.tool_parsers.base import ToolCallParser

MODULES_ENV = "DISAGG_TOOL_CALL_PARSER_MODULES"

_REGISTRY: "Registry[ToolCallParser]" = Registry(MODULES_ENV)


def register(name: str, parser: "str | ToolCallParser") -> None:
    """`parser` is a ToolCallParser, or "module:attr" naming one."""
    _REGISTRY.register(name, parser)


def names() -> tuple[str, ...]:
    return _REGISTRY.names()


def get(name: str) -> "ToolCallParser":
    parser = _REGISTRY.get(name)
    if parser is None:
        raise InvalidConfig(f"--tool-call-parser must be one of {list(names())}, got {name!r}")
    return parser


register("hermes", "services.router.tool_parsers.hermes:PARSER")
register("llama3_json", "services.router.tool_parsers.llama3:PARSER")
register("mistral", "services.router.tool_parsers.mistral:PARSER")

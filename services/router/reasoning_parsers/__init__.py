"""Reasoning parsers by name (`--reasoning-parser`; none by default): each splits an answer into its reasoning
(`reasoning_content`) and its content. A new one is its module and one `register` line here; one kept outside the
project is a module that calls `register`, named in DISAGG_REASONING_PARSER_MODULES (comma separated)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from common.errors import InvalidConfig
from services.router.registry import Registry

if TYPE_CHECKING:
    from services.router.reasoning_parsers.think import ThinkParser

MODULES_ENV = "DISAGG_REASONING_PARSER_MODULES"

_REGISTRY: "Registry[ThinkParser]" = Registry(MODULES_ENV)


def register(name: str, parser: "str | ThinkParser") -> None:
    """`parser` is a parser (stream() and parse(), as think.ThinkParser), or "module:attr" naming one."""
    _REGISTRY.register(name, parser)


def names() -> tuple[str, ...]:
    return _REGISTRY.names()


def get(name: str) -> "ThinkParser":
    parser = _REGISTRY.get(name)
    if parser is None:
        raise InvalidConfig(f"--reasoning-parser must be one of {list(names())}, got {name!r}")
    return parser


register("deepseek_r1", "services.router.reasoning_parsers.think:DEEPSEEK_R1")
register("qwen3", "services.router.reasoning_parsers.think:QWEN3")

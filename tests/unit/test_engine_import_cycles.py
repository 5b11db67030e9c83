"""common/engine has no import circles: factories live beside their callers, not in the modules their products
import (issue #25). Function-level imports count; the registries' by-name loads (import_module) do not."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "common" / "engine"


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _edges() -> dict[str, set[str]]:
    modules = {_module(p) for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = {f"{node.module}.{a.name}" for a in node.names} & modules  # `from pkg import sub`
                found |= submodules or {node.module}
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        edges[_module(path)] = found & modules - {_module(path)}
    return edges


def _cycle_from(start: str, edges: dict[str, set[str]]) -> list[str] | None:
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in edges.get(node, ()):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_common_engine_has_no_import_circles():
    edges = _edges()
    cycles = [c for m in sorted(edges) if (c := _cycle_from(m, edges))]
    assert not cycles, " ; ".join(" → ".join(c) for c in cycles)

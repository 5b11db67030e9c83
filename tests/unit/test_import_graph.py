"""The import graph of common/ has no circle, and KV is layered (issue #36): the engine imports from common.kv only
its vocabulary (common.kv.VOCABULARY), which imports nothing of the engine's or the transports'. Every import counts,
at any depth of a module's code: function-level ones and those only for type checking too."""
from __future__ import annotations

import ast
from pathlib import Path

from common.kv import VOCABULARY

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("common.pb",)


def _modules(package: str = "common") -> dict[str, Path]:
    found = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if not name.startswith(GENERATED):
            found[name] = path
    return found


def _ours(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that an imported name lives in (a package's __init__ for a name it defines)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module → the modules of common/ it imports (itself and the package it is in left out)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.update(f"{node.module}.{a.name}" for a in node.names)
        found = {_ours(i, modules) for i in imported if i.split(".")[0] == "common"}
        graph[name] = {m for m in found if m is not None and m != name and not name.startswith(f"{m}.")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "common.kv.transport" in graph["common.kv.paths"]  # `from common.kv import transport`
    assert "common.kv.blocks" in graph["common.engine.interface"]  # `from common.kv.blocks import KvBlocks`
    cuda_ipc = "common.kv.transports.cuda_ipc"
    assert f"{cuda_ipc}.peer_copy" in graph[f"{cuda_ipc}.block_copy"]  # a function-level import
    assert "common.kv.wire" in graph["common.kv.transport"]  # an import for type checking only


def test_common_has_no_import_circle():
    assert circles(import_graph()) == []


def test_the_engine_imports_only_the_kv_vocabulary():
    graph = import_graph()
    assert set(VOCABULARY) <= set(graph), "VOCABULARY names a module that does not exist"
    from_engine = {(module, kv) for module, imported in graph.items() if module.startswith("common.engine")
                   for kv in imported if kv.startswith("common.kv") and kv not in VOCABULARY}
    assert from_engine == set(), "the engine imports these KV modules beyond the vocabulary"


def test_the_kv_vocabulary_imports_neither_the_engine_nor_the_transports():
    graph = import_graph()
    beyond = {(module, imported) for module in VOCABULARY for imported in graph[module]
              if imported.startswith("common.engine")
              or imported.startswith("common.kv") and imported not in VOCABULARY}
    assert beyond == set()

"""The engine interface is the only way a service touches an engine (issue #17): every module under services/
(the workers, encode, the router, `disagg run`, ...), and every module of common/ they reach, imports from
common.engine only the interface, its seam for images, and the plain types the interface speaks in."""
from __future__ import annotations

import ast
import asyncio
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.engine.async_engine import AsyncLLMEngine
from common.engine.config import EngineConfig
from common.engine.interface import Engine, EngineRequest, KvSessionHost, OwnKvTransport
from common.engine.request import RequestType, SamplingParams
from common.engine.start import start_engine
from common.errors import NotFound
from services.cli.main import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[2]
SERVICE_MODULES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "services").rglob("*.py"))
INTERFACE = {"common.engine.interface", "common.engine.start", "common.engine.image_encoder"}
PLAIN_TYPES = {"common.engine.request", "common.engine.config", "common.engine.multimodal",
               "common.engine.default_model", "common.engine.stopping", "common.engine.structured",
               "common.engine.spec.config"}
ALLOWED = INTERFACE | PLAIN_TYPES


def _module_file(name: str, root: Path = ROOT) -> Path | None:
    base = root / name.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(path: Path, root: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code (function-level imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names
                         if _module_file(f"{node.module}.{a.name}", root))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _engine_modules_reached(path: Path, root: Path = ROOT) -> dict[str, str]:
    """common.engine modules reached from `path` through our own modules (stopping at common.engine), each with
    the module that imports it."""
    reached: dict[str, str] = {}
    seen, todo = {path}, [path]
    while todo:
        current = todo.pop()
        for name in _imported(current, root):
            if name == "common.engine":
                continue
            if name.startswith("common.engine."):
                reached.setdefault(name, current.relative_to(root).as_posix())
                continue
            found = _module_file(name, root) if name.split(".")[0] in ("common", "services") else None
            if found is not None and found not in seen:
                seen.add(found)
                todo.append(found)
    return reached


def test_the_walk_covers_every_service_and_subcommand():
    assert {"services/router/server.py", "services/encode/__main__.py", "services/encode/server.py",
            "services/cli/run_local.py", "services/cli/main.py", "services/decode/server.py"} <= set(SERVICE_MODULES)
    for module, _ in SUBCOMMANDS.values():
        assert _module_file(module).relative_to(ROOT).as_posix() in SERVICE_MODULES, module


@pytest.mark.parametrize("module", SERVICE_MODULES)
def test_services_reach_the_engine_only_through_the_interface(module):
    offending = {name: via for name, via in _engine_modules_reached(ROOT / module).items() if name not in ALLOWED}
    assert not offending, f"{module} reaches engine internals (module: imported by): {offending}"


def test_the_walk_sees_an_engine_internal_reached_through_common(tmp_path):
    (tmp_path / "common").mkdir()
    (tmp_path / "services").mkdir()
    (tmp_path / "common" / "helper.py").write_text("def f():\n    from common.engine.engine import LLMEngine\n")
    service = tmp_path / "services" / "probe.py"
    service.write_text("from common import helper\nfrom common.engine.interface import Engine\n")
    assert _engine_modules_reached(service, tmp_path) == {"common.engine.engine": "common/helper.py",
                                                          "common.engine.interface": "services/probe.py"}


@pytest.mark.parametrize("module", SERVICE_MODULES)
def test_services_never_reach_into_the_engine_through_call(module):
    text = (ROOT / module).read_text()
    assert ".call(" not in text and "engine.engine" not in text, module


def test_the_router_loads_no_torch():
    script = "import json, sys, services.router.server, services.router.__main__; print(json.dumps(sorted(m for m " \
             "in sys.modules if m.split('.')[0] == 'torch' or m.startswith('common.engine.'))))"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    reached = set(json.loads(result.stdout))
    assert not any(m.split(".")[0] == "torch" for m in reached), reached
    assert reached <= PLAIN_TYPES, reached


def _methods(*protocols) -> dict[str, object]:
    return {name: getattr(p, name) for p in protocols for name, _ in inspect.getmembers(p, inspect.isfunction)
            if not name.startswith("_")}


def test_our_engine_implements_every_method_of_the_interface():
    protocols = _methods(Engine, KvSessionHost)
    wanted = set(protocols)
    missing = {name for name in wanted if not callable(getattr(AsyncLLMEngine, name, None))}
    assert not missing
    for name in wanted:  # the same parameters, so a second engine can stand in
        ours = getattr(AsyncLLMEngine, name)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(protocols[name]).parameters), name
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(protocols[name]), name


def test_our_engine_hands_kv_to_the_data_plane_and_refuses_an_engine_handoff(tiny_llama):
    engine = start_engine(EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=64))

    async def run():
        facts = await engine.facts()
        context_only = EngineRequest("p", list(range(3, 22)), SamplingParams(temperature=0, max_tokens=4),
                                     RequestType.CONTEXT_ONLY)
        outs = [o async for o in engine.generate(context_only)]
        attributes = await engine.session_attributes(outs[-1].session_id)
        await engine.release_session(outs[-1].session_id)
        with pytest.raises(NotFound):
            await engine.session_attributes(outs[-1].session_id)
        return facts, attributes

    try:
        facts, attributes = asyncio.run(run())
        assert isinstance(engine, KvSessionHost) and not isinstance(engine, OwnKvTransport)
    finally:
        engine.shutdown()
    assert (facts.name, attributes) == ("torch", {})


def test_the_tensorrt_llm_engine_implements_every_method_of_the_interface():
    from common.engine.trtllm import TrtLlmEngine  # importable without TensorRT-LLM: it loads lazily

    protocols = _methods(Engine, OwnKvTransport)
    for name, wanted in protocols.items():
        theirs = getattr(TrtLlmEngine, name, None)
        assert callable(theirs), name
        assert list(inspect.signature(theirs).parameters) == list(inspect.signature(wanted).parameters), name
        assert inspect.iscoroutinefunction(theirs) == inspect.iscoroutinefunction(wanted), name

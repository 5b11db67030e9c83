"""The engine interface is the only way the engine workers' services touch an engine (issue #17):
their modules import from common.engine only the interface and the plain request/config types."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

from common.engine.async_engine import AsyncLLMEngine
from common.engine.interface import Engine

ROOT = Path(__file__).resolve().parents[2]
WORKER_SERVICES = ["services/worker_service.py", "services/worker_shell.py", "services/tensor_store.py",
                   "services/prefill/server.py", "services/decode/server.py"]
ALLOWED = {"common.engine.interface", "common.engine.request", "common.engine.config", "common.engine.multimodal",
           "common.engine.default_model"}


def _engine_imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("common.engine"):
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(a.name for a in node.names if a.name.startswith("common.engine"))
    return modules


def test_worker_services_import_only_the_engine_interface():
    offending = {f: sorted(_engine_imports(ROOT / f) - ALLOWED) for f in WORKER_SERVICES}
    assert not any(offending.values()), offending


def test_worker_services_never_reach_into_the_engine_through_call():
    for f in WORKER_SERVICES:
        text = (ROOT / f).read_text()
        assert ".call(" not in text and "engine.engine" not in text, f


def test_our_engine_implements_every_method_of_the_interface():
    wanted = {name for name, _ in inspect.getmembers(Engine, inspect.isfunction) if not name.startswith("_")}
    missing = {name for name in wanted if not callable(getattr(AsyncLLMEngine, name, None))}
    assert not missing
    for name in wanted:  # the same parameters, so a second engine can stand in
        ours = list(inspect.signature(getattr(AsyncLLMEngine, name)).parameters)
        assert ours == list(inspect.signature(getattr(Engine, name)).parameters), name


def test_the_tensorrt_llm_engine_implements_every_method_of_the_interface():
    from common.engine.trtllm import TrtLlmEngine  # importable without TensorRT-LLM: it loads lazily

    wanted = {name for name, _ in inspect.getmembers(Engine, inspect.isfunction) if not name.startswith("_")}
    for name in wanted:
        theirs = getattr(TrtLlmEngine, name, None)
        assert callable(theirs), name
        assert list(inspect.signature(theirs).parameters) == list(inspect.signature(getattr(Engine, name)).parameters), name
        assert inspect.iscoroutinefunction(theirs) == inspect.iscoroutinefunction(getattr(Engine, name)), name

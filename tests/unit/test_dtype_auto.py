"""--dtype auto (the default): a GPU serves the checkpoint's half precision, never float32 unasked; the CPU float32."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from common import model_facts
from common.engine.config import auto_dtype, resolve_dtype
from services.worker.engine_flags import add_engine_args, engine_config_from_args
from tests.unit.test_dummy_load import config_dir


def _with_dtype(directory: Path, **keys: object) -> Path:
    config_dir(directory, "llama-gqa")
    path = directory / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("dtype", "torch_dtype")}
    path.write_text(json.dumps({**config, **keys}))
    model_facts._load.cache_clear()  # (facts are read once a directory; pytest may hand a later case the same path)
    return directory


@pytest.mark.parametrize(("keys", "expected"), [
    ({"torch_dtype": "bfloat16"}, "bfloat16"),
    ({"dtype": "float16"}, "float16"),
    ({"torch_dtype": "float32"}, "bfloat16"),  # a float32 checkpoint is served in half precision on a GPU
    ({}, "bfloat16"),
])
def test_a_gpu_serves_the_checkpoints_half_precision(tmp_path: Path, keys: dict, expected: str) -> None:
    assert auto_dtype("cuda", str(_with_dtype(tmp_path, **keys))) == expected
    assert auto_dtype("cuda:1", str(tmp_path)) == expected


def test_the_cpu_serves_float32_and_a_given_dtype_stands(tmp_path: Path) -> None:
    model = str(_with_dtype(tmp_path, torch_dtype="bfloat16"))
    assert auto_dtype("cpu", model) == "float32"
    assert resolve_dtype("float32", "cuda", model) == "float32"
    assert resolve_dtype("auto", "cuda", model) == "bfloat16"


def test_the_flag_defaults_to_auto_and_the_engine_config_holds_the_resolved_dtype(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    monkeypatch.delenv("DISAGG_DTYPE", raising=False)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    model = str(_with_dtype(tmp_path, torch_dtype="bfloat16"))
    args = parser.parse_args(["--model", model])
    assert args.dtype == "auto"
    assert engine_config_from_args(args).dtype == "float32"
    assert engine_config_from_args(parser.parse_args(["--model", model, "--dtype", "bfloat16"])).dtype == "bfloat16"

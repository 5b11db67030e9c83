"""Load a Hugging Face model directory (config.json + safetensors) into our model classes."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig

from common.engine.models.llama import LlamaForCausalLM, RotaryEmbedding, head_dim_of
from common.engine.models.llava import is_vision_language, language_state, text_config_of
from common.errors import InvalidConfig

# Checkpoint entries that are derived state, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Our fused projections and the checkpoint's projections whose rows they hold, in order (weights and biases).
FUSED_PROJECTIONS = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
)


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


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's q/k/v and gate/up tensors of every layer concatenated into our fused ones (others kept)."""
    out = dict(state)
    for key in state:
        for fused, parts in FUSED_PROJECTIONS:
            prefix, dot, param = key.rpartition(".")
            if not prefix.endswith("." + parts[0]):
                continue
            layer = prefix.removesuffix(parts[0])
            names = [f"{layer}{part}.{param}" for part in parts]
            if not all(n in out for n in names):
                continue  # an incomplete set: left for the strict key check to report
            out[f"{layer}{fused}.{param}"] = torch.cat([out.pop(n) for n in names], dim=0)
    return out


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> tuple[LlamaForCausalLM, PretrainedConfig]:
    """Our language model and its config (a vision-language checkpoint's text half; the vision half is llava.py's)."""
    model_dir = Path(model_dir)
    full_config = load_config(model_dir)
    config = text_config_of(full_config)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = load_state(model_dir, device)
    if is_vision_language(full_config):
        state = language_state(state)
    state = fuse_projections({k: v.to(dtype) for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)})
    tied = getattr(config, "tie_word_embeddings", False)
    if tied:
        state.pop("lm_head.weight", None)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise InvalidConfig(
            f"checkpoint in {model_dir} does not match the {config.model_type} model: "
            f"missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = RotaryEmbedding(config, head_dim_of(config)).to(device)
    return model.eval(), config

"""LLaVA (Hugging Face LlavaForConditionalGeneration checkpoints): HF's vision tower and projector, our language model.

The language model is any registered family (models/registry.py, by the text config) loaded from
`model.language_model.*`;
the encode worker runs only the vision half (`model.vision_tower.*`, `model.multi_modal_projector.*`)
with transformers' own modules, so image features match HF exactly.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel, PretrainedConfig
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from common.engine.models.checkpoint import load_config, load_state
from common.engine.models.contract import CausalLM, KvShape
from common.engine.models.registry import model_class
from common.engine.models.sharding import Shard
from common.engine.parallel import SINGLE, TensorParallel
from common.errors import InvalidConfig

VISION_MODEL_TYPES = ("llava",)
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")
# Checkpoint name prefixes across transformers versions (the legacy layout is what save_pretrained writes).
_RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("vision_tower.vision_model.", "vision_tower."))


def is_vision_language(config: PretrainedConfig) -> bool:
    return config.model_type in VISION_MODEL_TYPES


def text_config_of(config: PretrainedConfig) -> PretrainedConfig:
    return config.text_config if is_vision_language(config) else config


def image_token_id(config: PretrainedConfig) -> int | None:
    """The placeholder token that image embeddings replace; None for a text-only model."""
    if not is_vision_language(config):
        return None
    return int(getattr(config, "image_token_id", None) or config.image_token_index)


def num_image_tokens(config: PretrainedConfig) -> int:
    """Embedding rows per image: one per patch, plus CLS when the select strategy is "full"."""
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return patches + (1 if config.vision_feature_select_strategy == "full" else 0)


def _normalised(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Entries as `model.*` / `lm_head.*` (language) and `vision_tower.*` / `multi_modal_projector.*`."""
    out = {}
    for key, value in state.items():
        for old, new in _RENAMES:
            if key.startswith(old):
                key = new + key.removeprefix(old)
        out[key] = value
    return out


def language_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LLaVA checkpoint's language-model entries under our Llama names (`model.*`, `lm_head.*`)."""
    return {k: v for k, v in _normalised(state).items() if not k.startswith(_VISION_PREFIXES)}


class LlavaForConditionalGeneration(CausalLM):
    """The language half of a LLaVA checkpoint: the registered model of its text config, under `language_model.`
    (the encode worker runs the vision half, VisionEncoder below)."""

    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = config.text_config
        self.language_model = model_class(self.config)(self.config, tp)
        self.packed_modules_mapping = self.language_model.packed_modules_mapping
        self.tied_keys = tuple(f"language_model.{k}" for k in self.language_model.tied_keys)

    def checkpoint_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inner = self.language_model.checkpoint_state(language_state(state))
        return {f"language_model.{k}": v for k, v in inner.items()}

    def forward(self, input_ids, positions, kv_caches, meta, backend, inputs_embeds=None) -> torch.Tensor:
        return self.language_model(input_ids, positions, kv_caches, meta, backend, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed(input_ids)

    def kv_shape(self) -> KvShape:
        return self.language_model.kv_shape()

    def tp_plan(self) -> dict[str, Shard]:
        return self.language_model.tp_plan()

    def finish_loading(self, device: torch.device) -> None:
        self.language_model.finish_loading(device)


class VisionEncoder(nn.Module):
    """pixel_values [N, 3, H, W] → image embeddings [N, num_image_tokens, text hidden], as HF's get_image_features."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if not isinstance(config.vision_feature_layer, int):
            raise InvalidConfig("vision_feature_layer lists are not supported; use a single layer index")
        self.config = config
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        outputs = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        features = outputs.hidden_states[self.config.vision_feature_layer]
        if self.config.vision_feature_select_strategy == "default":
            features = features[:, 1:]  # drop CLS
        return self.multi_modal_projector(features)


def load_vision_encoder(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> VisionEncoder:
    config = load_config(model_dir)
    if not is_vision_language(config):
        raise InvalidConfig(f"model {model_dir} ({config.model_type}) has no vision tower; "
                            f"image models supported: {VISION_MODEL_TYPES}")
    encoder = VisionEncoder(config)
    state = {k: v for k, v in _normalised(load_state(model_dir, device)).items() if k.startswith(_VISION_PREFIXES)}
    result = encoder.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("position_ids")]
    if missing or result.unexpected_keys:
        raise InvalidConfig(f"vision weights in {model_dir} do not match the model: missing {missing[:5]}, "
                            f"unexpected {result.unexpected_keys[:5]}")
    return encoder.to(device=device, dtype=dtype).eval()


def load_image_processor(model_dir: str | Path):
    """The checkpoint's own HF image processor (resize, crop, normalise), the PIL backend (no torchvision here)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True, backend="pil")

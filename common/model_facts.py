"""What the serving path needs to know of a model, read once from its JSON files (no torch, no transformers).

The router, the client side and the engine all take EOS ids, vocabulary size, context length and the
image placeholder from here, so they agree by construction. Values follow Hugging Face semantics:
`generate` stops on the union of the model config's and the generation config's `eos_token_id`; a
LLaVA directory keeps its language model's facts under `text_config`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from common.errors import InvalidConfig

VISION_LANGUAGE_MODEL_TYPES = ("llava",)
# LlavaConfig's defaults when config.json leaves them out (transformers' configuration_llava.py).
_LLAVA_IMAGE_TOKEN_INDEX = 32000
_LLAVA_SELECT_STRATEGY = "default"
_LLAVA_VISION_DEFAULTS = {"image_size": 336, "patch_size": 14}  # vision_config absent altogether
_CLIP_VISION_DEFAULTS = {"image_size": 224, "patch_size": 32}  # CLIPVisionConfig, keys absent


@dataclass(frozen=True)
class ModelFacts:
    model_type: str
    architectures: tuple[str, ...]
    vocab_size: int
    max_position_embeddings: int | None
    eos_token_ids: frozenset[int]
    image_token_id: int | None = None  # None: the model takes no images
    num_image_tokens: int = 0  # placeholder tokens (embedding rows) per image
    checkpoint_dtype: str | None = None  # config.json's `dtype` (`torch_dtype` in older files); None: not named

    @property
    def accepts_images(self) -> bool:
        return self.image_token_id is not None


def load_model_facts(model_dir: str | Path) -> ModelFacts:
    """Facts of the model in model_dir; InvalidConfig names the file and key when one is missing."""
    return _load(str(Path(model_dir).resolve()))


@lru_cache(maxsize=16)
def _load(model_dir: str) -> ModelFacts:
    root = Path(model_dir)
    config = _read_json(root / "config.json", required=True)
    model_type = str(config.get("model_type", ""))
    vision = model_type in VISION_LANGUAGE_MODEL_TYPES
    text = (config.get("text_config") or {}) if vision else config
    if "vocab_size" not in text:
        where = "text_config.vocab_size" if vision else "vocab_size"
        raise InvalidConfig(f"{root / 'config.json'} has no {where}; cannot tell the model's vocabulary size")
    generation = _read_json(root / "generation_config.json", required=False)
    eos = _ids(config.get("eos_token_id")) | _ids(generation.get("eos_token_id"))
    if vision:
        eos |= _ids(text.get("eos_token_id"))
    max_positions = text.get("max_position_embeddings")
    return ModelFacts(
        model_type=model_type,
        architectures=tuple(config.get("architectures") or ()),
        vocab_size=int(text["vocab_size"]),
        max_position_embeddings=int(max_positions) if max_positions is not None else None,
        eos_token_ids=frozenset(eos),
        image_token_id=_image_token_id(config) if vision else None,
        num_image_tokens=_num_image_tokens(config) if vision else 0,
        checkpoint_dtype=next((c[k] for c in (config, text) for k in ("dtype", "torch_dtype") if c.get(k)), None),
    )


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise InvalidConfig(f"{path} does not exist; a model directory needs a Hugging Face config.json")
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"{path} is not readable JSON: {exc}") from exc


def _ids(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def _image_token_id(config: dict[str, Any]) -> int:
    token = config.get("image_token_id")
    if token is None:
        token = config.get("image_token_index", _LLAVA_IMAGE_TOKEN_INDEX)
    return int(token)


def _num_image_tokens(config: dict[str, Any]) -> int:
    """One row per patch, plus CLS when the select strategy is "full" (as models/llava.num_image_tokens)."""
    vision = config.get("vision_config")
    sizes = {**_CLIP_VISION_DEFAULTS, **vision} if vision else _LLAVA_VISION_DEFAULTS
    patches = (int(sizes["image_size"]) // int(sizes["patch_size"])) ** 2
    full = config.get("vision_feature_select_strategy", _LLAVA_SELECT_STRATEGY) == "full"
    return patches + (1 if full else 0)

"""Images → embeddings with a checkpoint's own image processor and vision half (the encode worker's engine).

Part of the engine interface (common.engine.interface): the one entry point the encode worker uses, so it
never reaches into common.engine.models.
"""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from common.engine.config import _DTYPES
from common.engine.models.llava import load_image_processor, load_vision_encoder, num_image_tokens
from common.engine.models.loader import load_config
from common.errors import InvalidConfig


class ImageEncoder:
    """Not thread-safe: one caller at a time (the encode worker runs it on one thread)."""

    def __init__(self, model_dir: str | Path, dtype: str = "float32", device: str = "cpu"):
        if dtype not in _DTYPES:
            raise InvalidConfig(f"--dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.device = torch.device(device)
        self.config = load_config(model_dir)
        self.encoder = load_vision_encoder(model_dir, _DTYPES[dtype], self.device)
        self.processor = load_image_processor(model_dir)
        self.dtype = _DTYPES[dtype]
        self.tokens_per_image = num_image_tokens(self.config)
        self.hidden_size = self.config.text_config.hidden_size

    @torch.inference_mode()
    def encode(self, images: list[Image.Image]) -> list[torch.Tensor]:
        """One [tokens_per_image, hidden] CPU tensor per image."""
        pixels = self.processor(images, return_tensors="pt")["pixel_values"]
        features = self.encoder(pixels.to(device=self.device, dtype=self.dtype))
        return [f.cpu() for f in features]

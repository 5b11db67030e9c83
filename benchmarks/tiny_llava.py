"""Tiny LLaVA checkpoints (HF LlavaForConditionalGeneration + LlavaProcessor) built locally, and the HF reference.

Both use SmolLM2's tokenizer with an added <image> token and a small random CLIP vision tower:
`make_tiny_llava` has a tiny random Llama text model, `make_smollm2_llava` has SmolLM2-135M's own weights.
"""
from __future__ import annotations

import io
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (AutoTokenizer, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
                          LlavaProcessor)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from common.engine.default_model import default_model_dir

IMAGE_SIZE, PATCH_SIZE = 32, 8
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # the "default" strategy drops CLS


def _tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return tokenizer


def _save(directory: Path, text_config: LlamaConfig, tokenizer, seed: int,
          language_state: dict[str, torch.Tensor] | None = None) -> Path:
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text_config, vision_feature_layer=-2,
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default", image_seq_length=NUM_IMAGE_TOKENS)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    if language_state is not None:
        with torch.no_grad():
            model.model.language_model.load_state_dict(language_state)
            model.lm_head.weight.copy_(language_state["embed_tokens.weight"])
    model.save_pretrained(directory)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                   vision_feature_select_strategy="default", image_token="<image>",
                   num_additional_image_tokens=1).save_pretrained(directory)
    return directory


def make_tiny_llava(directory: Path, seed: int = 0) -> Path:
    tokenizer = _tokenizer()
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    return _save(directory, text, tokenizer, seed)


def make_smollm2_llava(directory: Path, seed: int = 0) -> Path:
    """SmolLM2-135M's weights as the text model (one embedding row added for <image>), random vision half."""
    from safetensors.torch import load_file

    source = default_model_dir()
    tokenizer = _tokenizer()
    text = LlamaConfig.from_pretrained(str(source))
    text.vocab_size, text.tie_word_embeddings = len(tokenizer), False  # lm_head is stored, equal to the embedding
    state = {k.removeprefix("model."): v.float() for k, v in load_file(str(source / "model.safetensors")).items()
             if k.startswith("model.")}
    embed = state["embed_tokens.weight"]
    torch.manual_seed(seed + 1)
    state["embed_tokens.weight"] = torch.cat([embed, embed.std() * torch.randn(len(tokenizer) - embed.shape[0],
                                                                               embed.shape[1])])
    return _save(directory, text, tokenizer, seed, state)


def png_bytes(seed: int, size: tuple[int, int] = (40, 50)) -> bytes:
    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@lru_cache(maxsize=2)
def _hf(model_dir: str):
    return (LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval(),
            LlavaProcessor.from_pretrained(model_dir))


@torch.inference_mode()
def hf_llava_greedy(model_dir: str, images: list[bytes], text: str, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids with placeholders expanded, greedy tokens of HF generate), eos stopping as generate does."""
    model, processor = _hf(model_dir)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(images=pil or None, text=text, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()

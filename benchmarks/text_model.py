"""A tiny random text model that serves text requests, for the benches (and the tests) that need no real weights."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.engine.default_model import default_model_dir


def make_text_model(directory: Path, max_position_embeddings: int = 256) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    LlamaForCausalLM(config).eval().save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir() / name, directory / name)
    return directory

"""Tiny random-weight Hugging Face checkpoints of each supported family, saved as real model dirs."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
               initializer_range=0.2)

TINY_FAMILIES = {
    "llama-gqa": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-tied-rope-scaled": (LlamaConfig, LlamaForCausalLM, dict(
        num_key_value_heads=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 128})),
    "qwen2-bias": (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-qknorm": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(num_key_value_heads=2, sliding_window=None)),
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(num_key_value_heads=2, pad_token_id=0, tie_word_embeddings=False)),
    # Sparse layer 0, dense layer 1 (mlp_only_layers); 8 experts, 2 a token, renormalised as Qwen3-30B-A3B's.
    "qwen3-moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_key_value_heads=2, num_local_experts=4,
                                                         num_experts_per_tok=2, sliding_window=None)),
}
# Beside the families: shapes a test needs that the families above do not have.
TINY_SHAPES = {
    # Four KV heads and an attention bias: tensor parallelism at 4 ranks, and o_proj's bias under the all-reduce.
    "llama-mha-bias": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4, attention_bias=True,
                                                           tie_word_embeddings=False)),
}


def make_tiny_model(directory: Path, family: str, seed: int = 0) -> Path:
    config_cls, model_cls, extra = {**TINY_FAMILIES, **TINY_SHAPES}[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**_COMMON, **extra)).eval()
    if family in ("qwen2-bias", "llama-mha-bias"):  # random init zeroes biases; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                    if proj.bias is not None:
                        proj.bias.normal_(0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return directory

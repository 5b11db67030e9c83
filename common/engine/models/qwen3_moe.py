"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (per-head q/k RMSNorm) and sparse MoE layers, except those
in `mlp_only_layers` and those off the `decoder_sparse_step` (dense MLPs of `intermediate_size`). The router's
top-k probabilities (softmax over every expert) are renormalised only with `norm_topk_prob`."""
from __future__ import annotations

from transformers import PretrainedConfig

from common.engine.models.llama import Attention, RMSNorm
from common.engine.models.moe import MoeSpec
from common.engine.models.moe_decoder import MoeForCausalLM
from common.engine.parallel import TensorParallel


class QkNormAttention(Attention):
    """llama.Attention with Qwen3's q/k norms (which it keys on model_type "qwen3")."""

    def __init__(self, config: PretrainedConfig, head_dim: int, window: int | None, tp: TensorParallel):
        super().__init__(config, head_dim, window, tp)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    attention = QkNormAttention

    @staticmethod
    def moe_spec(config: PretrainedConfig) -> MoeSpec:
        return MoeSpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       bool(config.norm_topk_prob))

    @staticmethod
    def sparse_layers(config: PretrainedConfig) -> list[bool]:
        """As transformers' Qwen3MoeDecoderLayer decides."""
        dense = set(config.mlp_only_layers or ())
        return [i not in dense and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
                for i in range(config.num_hidden_layers)]

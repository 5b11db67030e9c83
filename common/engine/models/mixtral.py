"""Mixtral (MixtralForCausalLM): Mistral's attention (one sliding window, if any, on every layer) and a sparse MoE
block on every layer, its router's top-k renormalised (the softmax over the top-k logits). Checkpoints name the
block `block_sparse_moe` and each expert's gate / down / up `w1` / `w2` / `w3`."""
from __future__ import annotations

from transformers import PretrainedConfig

from common.engine.models.moe import MoeSpec
from common.engine.models.moe_decoder import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    expert_names = ("w1", "w3", "w2")  # gate, up, down
    renames = ((".block_sparse_moe.", ".mlp."),)

    @staticmethod
    def moe_spec(config: PretrainedConfig) -> MoeSpec:
        return MoeSpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True)

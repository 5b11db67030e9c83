"""Phi-3 (Phi3ForCausalLM): the Llama decoder with q/k/v and gate/up already fused in the checkpoint
(`self_attn.qkv_proj`, `mlp.gate_up_proj`, in our row order), and one sliding window on every layer."""
from __future__ import annotations

from transformers import PretrainedConfig

from common.engine.models.llama import LlamaForCausalLM
from common.engine.parallel import SINGLE, TensorParallel
from common.errors import InvalidConfig


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = {}  # nothing to fuse: the checkpoint's modules are ours

    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE):
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("partial_rotary_factor", 1.0) != 1.0 or rope.get("rope_type", "default") == "longrope":
            raise InvalidConfig("Phi-3 with partial rotary or longrope scaling is not supported")
        super().__init__(config, tp)

    @staticmethod
    def layer_windows(config: PretrainedConfig) -> list[int | None]:
        return [getattr(config, "sliding_window", None)] * config.num_hidden_layers

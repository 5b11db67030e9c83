"""The Llama decoder with a sparse MoE block (models/moe.py) in place of the MLP on its sparse layers: what the
MoE families (Qwen3-MoE, Mixtral) share. Attention, norms, RoPE, the paged cache, the vocabulary split and the
lm head are llama.py's; a family module says which layers are sparse, its router's normalisation and its
checkpoint's expert names.

Checkpoints name experts one module each (`experts.{e}.gate_proj` …, what transformers' save_pretrained writes,
or Mixtral's `block_sparse_moe.experts.{e}.w1` …) or already stacked (`experts.gate_up_proj` [E, 2I, H], `experts.
down_proj` [E, H, I], transformers' in-memory names); `checkpoint_state` stacks the former into the latter.
"""
from __future__ import annotations

import re
from abc import abstractmethod
from collections import defaultdict

import torch
from torch import nn
from transformers import PretrainedConfig

from common.engine.kernels import norm_linear
from common.engine.models.contract import head_dim_of
from common.engine.models.llama import (MLP, Attention, LlamaForCausalLM, RMSNorm, RotaryEmbedding,
                                        VocabParallelEmbedding)
from common.engine.models.moe import MoeSpec, SparseMoeBlock
from common.engine.models.sharding import ExpertColumns, Shard
from common.engine.parallel import SINGLE, TensorParallel
from common.errors import InvalidConfig

_EXPERT_KEY = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.weight")


def stack_experts(state: dict[str, torch.Tensor], names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """Per-expert tensors `<layer>.experts.{e}.{gate|up|down}.weight` (names: the checkpoint's three) stacked into
    `<layer>.experts.gate_up_proj` [E, 2I, H] (gate ‖ up rows per expert) and `<layer>.experts.down_proj`."""
    gate, up, down = names
    found: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    out = {}
    for key, tensor in state.items():
        match = _EXPERT_KEY.fullmatch(key)
        if match and match[3] in names:
            found[match[1]][match[3]][int(match[2])] = tensor
        else:
            out[key] = tensor
    for prefix, parts in found.items():
        count = 1 + max(max(p) for p in parts.values())
        if any(len(parts[n]) != count for n in names):
            raise InvalidConfig(f"checkpoint's {prefix} lacks some of its {count} experts' {'/'.join(names)}")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat((parts[gate][e], parts[up][e])) for e in range(count)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[down][e] for e in range(count)])
    return out


class MoeDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, window: int | None, tp: TensorParallel,
                 attention: type[Attention], moe: MoeSpec | None):
        super().__init__()
        self.self_attn = attention(config, head_dim, window, tp)
        self.mlp = MLP(config, tp) if moe is None else SparseMoeBlock(moe, config.hidden_size, tp)
        self.sparse = moe is not None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, positions, rope, kv_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP / MoE output, the residual stream before it); the caller's next norm adds the two."""
        qkv, residual = norm_linear(x, residual, self.input_layernorm, self.self_attn.qkv_proj)
        h = self.self_attn(qkv, positions, rope, kv_cache, meta, backend)
        if self.sparse:
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h), residual
        gate_up, residual = norm_linear(h, residual, self.post_attention_layernorm, self.mlp.gate_up_proj)
        return self.mlp(gate_up), residual


class MoeModel(nn.Module):
    """llama.Model's parts, with MoE layers."""

    def __init__(self, config: PretrainedConfig, layers: list[MoeDecoderLayer], tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))


class MoeForCausalLM(LlamaForCausalLM):
    """The base of an MoE family: its module sets the class attributes and `moe_spec`."""

    attention: type[Attention] = Attention
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert checkpoint modules
    renames: tuple[tuple[str, str], ...] = ()  # (checkpoint name part, ours)

    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE):
        nn.Module.__init__(self)  # LlamaForCausalLM's fields, built here with MoE layers
        self.config = config
        self.tp = tp
        self.windows = self.layer_windows(config)
        spec, head_dim = self.moe_spec(config), head_dim_of(config)
        layers = [MoeDecoderLayer(config, head_dim, window, tp, self.attention, spec if sparse else None)
                  for window, sparse in zip(self.windows, self.sparse_layers(config))]
        self.model = MoeModel(config, layers, tp)
        self.lm_head = nn.Linear(config.hidden_size, self.model.embed_tokens.num_embeddings, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
            self.tied_keys = ("lm_head.weight",)

    @staticmethod
    @abstractmethod
    def moe_spec(config: PretrainedConfig) -> MoeSpec:
        """The family's sparse block, from its config."""

    @staticmethod
    def sparse_layers(config: PretrainedConfig) -> list[bool]:
        return [True] * config.num_hidden_layers

    @staticmethod
    def layer_windows(config: PretrainedConfig) -> list[int | None]:
        return [getattr(config, "sliding_window", None)] * config.num_hidden_layers

    def checkpoint_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for old, new in self.renames:
            state = {key.replace(old, new): tensor for key, tensor in state.items()}
        return stack_experts(state, self.expert_names)

    def tp_plan(self) -> dict[str, Shard]:
        return {**super().tp_plan(), "mlp.experts": ExpertColumns()}  # dense layers' MLPs split as llama's

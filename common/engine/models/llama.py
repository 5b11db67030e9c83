"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) on a paged KV cache.

Module names mirror Hugging Face's, except two fused projections: `qkv_proj` (q ‖ k ‖ v rows, one GEMM)
and `gate_up_proj` (gate ‖ up rows); the loader concatenates the checkpoint's tensors into them.
embed → N × (norm, attention, norm, MLP) → norm → lm head, with each residual add fused into the next norm.
On CUDA the norms, SiLU-and-mul and RoPE run as Triton kernels (common/engine/kernels), on the CPU in bf16 as C
kernels (common/engine/cpu_ops.py); elsewhere in torch.
Under tensor parallelism (common/engine/parallel.py) each rank builds its share: its heads, its slice of the
MLP and of the vocabulary, cut from the checkpoint by `tp_plan`; o_proj and down_proj end in an all-reduce.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from common.engine.attention import TorchAttentionMetadata, TorchPagedAttention
from common.engine.kernels import (add_rms_norm, linear, norm_linear, rms_norm, rope_store_kv, rope_store_on_cpu,
                                   silu_linear)
from common.engine.models.contract import CausalLM, KvShape, head_dim_of
from common.engine.models.sharding import Colwise, Rowwise, Shard, VocabRows
from common.engine.parallel import SINGLE, TensorParallel
from common.errors import InvalidConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual: (norm(x + residual), x + residual), the add fused into the norm."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """RoPE with the config's scaling (linear, yarn, llama3, ...) via transformers' own init functions."""

    def __init__(self, config: PretrainedConfig, head_dim: int):
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "dynamic":
            raise InvalidConfig("rope_type 'dynamic' rescales with sequence length and is not supported")
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = float(scaling)
        self.max_positions = int(config.max_position_embeddings)
        self._caches: dict[torch.dtype, torch.Tensor] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def cos_sin_cache(self, dtype: torch.dtype) -> torch.Tensor:
        """[max_positions, head_dim]: cos of the first half-frequencies ‖ their sin, the values forward() gives.
        Built once (outside any CUDA-graph capture: the warm-up forward builds it)."""
        if dtype not in self._caches:
            cos, sin = self.forward(torch.arange(self.max_positions, device=self.inv_freq.device), dtype)
            half = cos.shape[-1] // 2
            self._caches[dtype] = torch.cat((cos[:, :half], sin[:, :half]), dim=-1).contiguous()
        return self._caches[dtype]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def _attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
    """(q/k/v bias, o bias): Qwen2 always has q/k/v bias; Llama and Qwen3 follow attention_bias."""
    if config.model_type == "qwen2":
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


class VocabParallelEmbedding(nn.Embedding):
    """Token embeddings of this rank's vocabulary rows; ids held by other ranks give zeros, summed over ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        self.start, self.end = tp.vocab_range(vocab_size)
        super().__init__(-(-vocab_size // tp.size), hidden_size)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        outside = (input_ids < self.start) | (input_ids >= self.end)
        out = F.embedding((input_ids - self.start).masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0))


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, window: int | None, tp: TensorParallel):
        super().__init__()
        self.num_heads = tp.split(config.num_attention_heads, "attention heads")
        self.num_kv_heads = tp.split(config.num_key_value_heads, "KV heads")
        self.tp = tp
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.window = window
        qkv_bias, o_bias = _attention_biases(config)
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, config.hidden_size, bias=o_bias)
        if config.model_type == "qwen3":  # per-head RMSNorm on q and k, before RoPE
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, qkv, positions: torch.Tensor, rope, kv_cache, meta, backend: TorchPagedAttention) -> torch.Tensor:
        """qkv: this layer's qkv_proj output (the decoder layer runs it, fused with the norm before it).
        rope: (cos, sin) [T, D] for a backend that stores K/V itself; else the rotary cos_sin_cache
        [max_positions, D], and one kernel applies q/k norms and RoPE while it writes K and V into the cache."""
        T = qkv.shape[0]
        if not isinstance(rope, tuple):
            q = rope_store_kv(qkv, positions, rope, kv_cache[0], kv_cache[1], meta.slot_mapping, self.num_heads,
                              self.num_kv_heads, self.head_dim, self.q_norm, self.k_norm)
            out = backend.attend(q, kv_cache, meta, self.scale, self.window)
            return self.tp.all_reduce(linear(out.reshape(T, -1), self.o_proj))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale, self.window)
        return self.tp.all_reduce(linear(out.reshape(T, -1), self.o_proj))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        intermediate = tp.split(config.intermediate_size, "MLP columns (intermediate_size)")
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, config.hidden_size, bias=bias)
        self.tp = tp

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: this layer's gate_up_proj output (the decoder layer runs it, fused with the norm before it)."""
        return self.tp.all_reduce(silu_linear(gate_up, self.down_proj))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, window: int | None, tp: TensorParallel):
        super().__init__()
        self.self_attn = Attention(config, head_dim, window, tp)
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, positions, rope, kv_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the caller's next norm adds the two."""
        qkv, residual = norm_linear(x, residual, self.input_layernorm, self.self_attn.qkv_proj)
        h = self.self_attn(qkv, positions, rope, kv_cache, meta, backend)
        gate_up, residual = norm_linear(h, residual, self.post_attention_layernorm, self.mlp.gate_up_proj)
        return self.mlp(gate_up), residual


class Model(nn.Module):
    def __init__(self, config: PretrainedConfig, windows: list[int | None], tp: TensorParallel):
        super().__init__()
        head_dim = head_dim_of(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, head_dim, w, tp) for w in windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim)


class LlamaForCausalLM(CausalLM):
    packed_modules_mapping = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    }
    # EAGLE-3 (common/engine/spec/eagle3.py): the layers whose input (the residual stream entering them; the number
    # of layers: the stream after the last) forward keeps in `aux_hidden` [T, len(aux_layers) * hidden]; () keeps none.
    aux_layers: tuple[int, ...] = ()
    aux_hidden: torch.Tensor | None = None

    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        self.windows = self.layer_windows(config)
        self.model = Model(config, self.windows, tp)
        self.lm_head = nn.Linear(config.hidden_size, self.model.embed_tokens.num_embeddings, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
            self.tied_keys = ("lm_head.weight",)

    @staticmethod
    def layer_windows(config: PretrainedConfig) -> list[int | None]:
        """Per-layer sliding window (None = full attention), as the HF config declares it."""
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            return [window if t == "sliding_attention" else None for t in layer_types]
        if config.model_type == "mistral":
            return [window] * config.num_hidden_layers
        return [None] * config.num_hidden_layers

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] packed tokens of every request in the step
        positions: torch.Tensor,  # [T]
        kv_caches: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: TorchAttentionMetadata,
        backend: TorchPagedAttention,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: replaces the token embeddings (images spliced in)
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rotary = self.model.rotary_emb
        fused = backend.fused_rope_store or rope_store_on_cpu(x, kv_caches[0][0])
        rope = rotary.cos_sin_cache(x.dtype) if fused else rotary(positions, x.dtype)
        residual, keep, kept = None, self.aux_layers, []
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            if keep and i in keep:  # (layer 0's input, the embeddings, is then updated in place: a copy)
                kept.append(x.clone() if residual is None else x + residual)
            x, residual = layer(x, residual, positions, rope, kv_cache, meta, backend)
        if keep:
            if len(self.model.layers) in keep:
                kept.append(x + residual)
            self.aux_hidden = torch.cat(kept, dim=-1)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(linear(hidden, self.lm_head).float())
        return logits if self.tp.size == 1 else logits[:, : self.config.vocab_size]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def kv_shape(self) -> KvShape:
        c = self.config
        return KvShape(c.num_hidden_layers, c.num_key_value_heads, head_dim_of(c), tuple(self.windows))

    def tp_plan(self) -> dict[str, Shard]:
        c, head_dim = self.config, head_dim_of(self.config)
        kv_rows = c.num_key_value_heads * head_dim
        return {"self_attn.qkv_proj": Colwise((c.num_attention_heads * head_dim, kv_rows, kv_rows)),
                "mlp.gate_up_proj": Colwise((c.intermediate_size, c.intermediate_size)),
                "self_attn.o_proj": Rowwise(), "mlp.down_proj": Rowwise(),
                "embed_tokens": VocabRows(c.vocab_size), "lm_head": VocabRows(c.vocab_size)}

    def finish_loading(self, device: torch.device) -> None:
        if self.tied_keys:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.model.rotary_emb = RotaryEmbedding(self.config, head_dim_of(self.config)).to(device)

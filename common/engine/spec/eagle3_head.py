"""An EAGLE-3 head (Li et al. 2025) in the Hugging Face layout the public checkpoints use (EAGLE's, SpecForge's,
vLLM's and SGLang's "LlamaForCausalLMEagle3"), checked against its target and loaded on the target's device.

The checkpoint: config.json (a Llama config of one layer, `architectures` ["LlamaForCausalLMEagle3"],
`draft_vocab_size`, the target's `vocab_size`) and these tensors:
    fc.weight          [hidden, 3 * target hidden]: the target's residual stream at three layers, concatenated
    midlayer.*         one decoder layer whose q/k/v_proj read 2 * hidden: the token's embedding and the hidden
                       state, each normed (input_layernorm, hidden_norm), concatenated
    norm.weight, lm_head.weight [draft_vocab, hidden]
    d2t [draft_vocab]  a draft id's target id is the id plus d2t[id] (t2d, its inverse mask, is not needed)
    embed_tokens.weight  optional: without it the head embeds with the target's embeddings.
The three layers: vLLM's top-level `eagle_aux_hidden_state_layer_ids` name the layers whose input is taken;
SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` name layers whose output is (their next layer's input);
neither: the inputs of layers 2, L // 2 and L - 3, both engines' default. `norm_before_residual` (vLLM's key)
makes the normed hidden state the residual instead of the raw one.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from common.engine.kernels import linear, norm_linear, rope_store_on_cpu
from common.engine.models.checkpoint import load_config, load_state
from common.engine.models.contract import head_dim_of
from common.engine.models.dummy import dummy_state
from common.engine.models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm, RotaryEmbedding
from common.engine.models.loader import fuse_projections
from common.engine.models.registry import architecture_of
from common.engine.parallel import SINGLE
from common.engine.spec.config import FLAG
from common.errors import InvalidConfig

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# The targets whose forward keeps the hidden states a head reads (LlamaForCausalLM.aux_layers).
TARGETS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight")


class MidLayer(nn.Module):
    """The head's decoder layer: Llama's, but attention reads [norm(embedding) ‖ hidden_norm(hidden)]."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        head_dim = head_dim_of(config)
        self.self_attn = Attention(config, head_dim, None, SINGLE)
        attn = self.self_attn
        self.self_attn.qkv_proj = nn.Linear(2 * config.hidden_size, attn.q_size + 2 * attn.kv_size,
                                            bias=attn.qkv_proj.bias is not None)
        self.mlp = MLP(config, SINGLE)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Eagle3Head(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    tied_keys: tuple[str, ...] = ()

    def __init__(self, config: PretrainedConfig, fc_in: int, own_embeddings: bool):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(fc_in, config.hidden_size, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if own_embeddings else None
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def tp_plan(self) -> dict:
        return {}

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """(the final norm's output, the residual stream before it) [T, hidden] for tokens `embeds` [T, hidden]
        each beside the hidden state before it, `hidden` [T, hidden] (fc of the target's, or the head's own
        pre-norm output); K/V written into kv_cache [2, blocks, block_size, kv_heads, head_dim]."""
        layer = self.midlayer
        normed = layer.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        fused = backend.fused_rope_store or rope_store_on_cpu(x, kv_cache[0])
        rope = self.rotary_emb.cos_sin_cache(x.dtype) if fused else self.rotary_emb(positions, x.dtype)
        h = layer.self_attn(linear(x, layer.self_attn.qkv_proj), positions, rope, kv_cache, meta, backend)
        gate_up, residual = norm_linear(h, residual, layer.post_attention_layernorm, layer.mlp.gate_up_proj)
        return self.norm(layer.mlp(gate_up), residual)

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """The greedy token [N] of each row, as a target id."""
        ids = linear(normed, self.lm_head).argmax(dim=-1)
        return ids + self.d2t[ids]


def aux_layers(config: PretrainedConfig, num_layers: int, where: str) -> tuple[int, ...]:
    """The target layers whose input (the residual stream entering them; `num_layers`: after the last) the head
    reads, ascending, as the checkpoint's config names them (module docstring)."""
    eagle = getattr(config, "eagle_config", None) or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise InvalidConfig(f"{FLAG}: {where} reads one hidden state (eagle_config.use_aux_hidden_state false), an "
                            "EAGLE-1/2 head; eagle3 heads read three")
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None and eagle.get("eagle_aux_hidden_state_layer_ids") is not None:
        ids = [i + 1 for i in eagle["eagle_aux_hidden_state_layer_ids"]]  # (SGLang: a layer's output)
    layers = tuple(sorted(ids)) if ids is not None else (2, num_layers // 2, num_layers - 3)
    if len(set(layers)) != len(layers) or not all(0 <= i <= num_layers for i in layers):
        raise InvalidConfig(f"{FLAG}: {where} reads the target's layers {list(layers)}; the target has {num_layers} "
                            "(distinct ids in [0, num_layers] needed)")
    return layers


def head_aux_layers(model_dir: str, num_layers: int) -> tuple[int, ...]:
    """The target layers the head in `model_dir` reads (aux_layers), from its config alone: a GPU target's CUDA graphs
    are captured keeping them, before the head itself is loaded (load_head checks the rest)."""
    return aux_layers(_head_config(model_dir), num_layers, model_dir)


def _head_config(model_dir: str) -> PretrainedConfig:
    try:
        return load_config(model_dir)
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"{FLAG}: no EAGLE-3 head config in {model_dir}: {exc}") from None


def load_head(model_dir: str, target, dtype: torch.dtype, device: torch.device,
              dummy_seed: int | None = None) -> tuple[Eagle3Head, tuple[int, ...]]:
    """The head in `model_dir` on `device` and the target layers it reads; InvalidConfig naming the directory for
    a head that does not fit the target (LLMEngine) or is not a complete EAGLE-3 checkpoint. `dummy_seed`: random
    weights from config.json alone (--load-format dummy)."""
    tc = target.runner.hf_config
    if type(target.runner.model) is not LlamaForCausalLM or architecture_of(tc) not in TARGETS:
        raise InvalidConfig(f"{FLAG}: eagle3 heads run on Llama, Mistral and Qwen2/Qwen3 targets; "
                            f"{target.config.model} is {architecture_of(tc)}")
    config = _head_config(model_dir)
    if not set(getattr(config, "architectures", None) or ()) & set(ARCHITECTURES):
        raise InvalidConfig(f"{FLAG}: {model_dir} is not an EAGLE-3 head (architectures "
                            f"{getattr(config, 'architectures', None)}; expected one of {list(ARCHITECTURES)})")
    if getattr(config, "num_hidden_layers", 1) != 1:
        raise InvalidConfig(f"{FLAG}: the EAGLE-3 head in {model_dir} has {config.num_hidden_layers} layers; one "
                            "decoder layer (midlayer) is what the layout holds")
    if config.vocab_size != tc.vocab_size:
        raise InvalidConfig(f"{FLAG}: the EAGLE-3 head in {model_dir} is for a vocabulary of {config.vocab_size} "
                            f"tokens, the target {target.config.model} has {tc.vocab_size}")
    if getattr(config, "draft_vocab_size", None) is None:
        config.draft_vocab_size = config.vocab_size
    layers = aux_layers(config, tc.num_hidden_layers, model_dir)
    state = None if dummy_seed is not None else _tensors(model_dir, device)
    own_embeddings = state is not None and "embed_tokens.weight" in state
    if not own_embeddings and config.hidden_size != tc.hidden_size:
        raise InvalidConfig(f"{FLAG}: the EAGLE-3 head in {model_dir} has hidden size {config.hidden_size}, the "
                            f"target {target.config.model} {tc.hidden_size}, and no embed_tokens of its own")
    with torch.device("meta"):
        head = Eagle3Head(config, len(layers) * tc.hidden_size, own_embeddings)
    if state is None:
        state = dummy_state(head, config, dtype, device, SINGLE, dummy_seed)
    else:
        state = _checked(head, state, model_dir, dtype, len(layers) * tc.hidden_size)
    head.load_state_dict(state, strict=True, assign=True)
    head.rotary_emb = RotaryEmbedding(config, head_dim_of(config)).to(device)
    return head.eval(), layers


def _tensors(model_dir: str, device: torch.device) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: safetensors, or the pytorch_model.bin the EAGLE repository's heads ship."""
    path = Path(model_dir)
    if not list(path.glob("*.safetensors")) and (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", map_location=device, weights_only=True)
    return load_state(model_dir, device)


def _checked(head: Eagle3Head, state: dict[str, torch.Tensor], model_dir: str, dtype: torch.dtype,
             fc_in: int) -> dict[str, torch.Tensor]:
    state = {k.removeprefix("model."): v for k, v in state.items() if k != "t2d" and not k.endswith("inv_freq")}
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise InvalidConfig(f"{FLAG}: the EAGLE-3 head in {model_dir} lacks {missing}")
    if state["fc.weight"].shape[1] != fc_in:
        raise InvalidConfig(f"{FLAG}: the EAGLE-3 head in {model_dir} reads {state['fc.weight'].shape[1]} target "
                            f"features (fc.weight), the target's three layers give {fc_in}: another target's head")
    state.setdefault("d2t", torch.zeros(head.config.draft_vocab_size, dtype=torch.long))
    state = {k: v.to(dtype) if v.is_floating_point() else v.long() for k, v in state.items()}
    expected = head.state_dict()
    try:
        state = fuse_projections(state, head.packed_modules_mapping)
        wrong = sorted(set(state) ^ set(expected)) + [k for k in state if k in expected
                                                      and state[k].shape != expected[k].shape]
    except RuntimeError as exc:  # q, k and v (or gate and up) of widths that do not stack
        wrong = [str(exc)]
    if wrong:
        raise InvalidConfig(f"{FLAG}: the EAGLE-3 head in {model_dir} does not match its config.json "
                            f"(missing, unexpected or misshapen: {wrong[:6]})")
    return state

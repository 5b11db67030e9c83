"""What a speculative proposer takes of the device beside its target, so that the target's KV cache, sized from its
share of a GPU (common/engine/config.kv_cache_blocks), leaves room for it: a draft model's (or EAGLE-3 head's)
weights, and its own KV, which pages one block for every block of the target's pool plus each row's drafts.

Counted from config.json alone, on the meta device (transformers' model for a draft, our Eagle3Head for a head), at
the dtype the proposer will load: nothing is allocated, so the target can size itself before the proposer loads.
n-gram drafting holds nothing on the device."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from common.engine.models.checkpoint import load_config
from common.engine.models.contract import head_dim_of
from common.engine.spec.config import SpeculativeConfig


@dataclass(frozen=True)
class ProposerMemory:
    weight_bytes: int = 0
    """The proposer's weights."""
    block_bytes: int = 0
    """Its KV for one block of the target's pool (the same tokens: one of its blocks a target block)."""
    extra_blocks: int = 0
    """Its blocks beyond the target's count: every row's K + 1 drafted positions."""

    @property
    def fixed_bytes(self) -> int:
        """What it holds whatever the target's pool size."""
        return self.weight_bytes + self.extra_blocks * self.block_bytes


NOTHING = ProposerMemory()


def draft_rows_blocks(spec: SpeculativeConfig, max_num_seqs: int, block_size: int) -> int:
    """The blocks a proposer pages beyond the target's pool: each of the step's rows K + 1 positions."""
    return max_num_seqs * -(-(spec.num_speculative_tokens + 1) // block_size)


def proposer_memory(spec: SpeculativeConfig | None, target_hidden_size: int, dtype: torch.dtype, block_size: int,
                    max_num_seqs: int) -> ProposerMemory:
    """What the proposer of `spec` will hold on the target's device (NOTHING for none or n-gram)."""
    if spec is None or spec.method not in ("draft", "eagle3"):
        return NOTHING
    config = load_config(spec.model)
    if spec.method == "draft":
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        text = getattr(config, "text_config", None) or config
        layers = text.num_hidden_layers
    else:
        from common.engine.spec.eagle3_head import Eagle3Head

        if getattr(config, "draft_vocab_size", None) is None:
            config.draft_vocab_size = config.vocab_size
        with torch.device("meta"):
            model = Eagle3Head(config, 3 * target_hidden_size, _has_own_embeddings(spec.model))
        text, layers = config, 1
    weights = sum(p.numel() * dtype.itemsize for p in model.parameters())  # a tied embedding counted once
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    block_bytes = 2 * layers * block_size * kv_heads * head_dim_of(text) * dtype.itemsize
    return ProposerMemory(weights, block_bytes, draft_rows_blocks(spec, max_num_seqs, block_size))


def _has_own_embeddings(model_dir: str) -> bool:
    """Whether an EAGLE-3 checkpoint ships embed_tokens (read from its safetensors' headers; none: random weights
    from config.json, which embed with the target's, as load_head does)."""
    from safetensors import safe_open

    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            if any(key.removeprefix("model.") == "embed_tokens.weight" for key in f.keys()):
                return True
    return False

"""What every model family gives the engine: the contract the generic loader and the model runner rely on.

A family subclasses `CausalLM` in its own module under models/ and adds one line to models/registry.py.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from common.engine.models.sharding import Shard


@dataclass(frozen=True)
class KvShape:
    """The paged cache a model needs: [num_layers, 2, blocks, block_size, num_kv_heads, head_dim], and each
    layer's sliding window (None = full attention)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class CausalLM(nn.Module, ABC):
    """A language model on the paged KV cache. Built on the meta device, then loaded by models/loader.py.
    Constructed as `Family(config, tp)`: under tensor parallelism (common/engine/parallel.py) it builds this
    rank's share of every layer, and its collectives run inside forward / embed / compute_logits."""

    # Our fused module → the checkpoint modules whose rows it holds, in order (the loader concatenates them).
    packed_modules_mapping: dict[str, tuple[str, ...]] = {}
    # Parameters the checkpoint may omit because they share another's storage (set again by finish_loading).
    tied_keys: tuple[str, ...] = ()
    config: PretrainedConfig  # the language model's config

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor, meta, backend,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of the packed tokens of a step; K/V written into kv_caches."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab]."""

    @abstractmethod
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] (images are spliced into them before forward)."""

    @abstractmethod
    def kv_shape(self) -> KvShape:
        """The whole model's cache (every KV head); a rank holds num_kv_heads / tp_size of them."""

    def tp_plan(self) -> dict[str, Shard]:
        """How the checkpoint splits across ranks, per module (models/sharding.py); empty: this family runs on one
        rank only."""
        return {}

    def checkpoint_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under this model's parameter names (a wrapper renames or drops some)."""
        return state

    def finish_loading(self, device: torch.device) -> None:
        """After the weights are assigned: re-tie shared parameters, build derived buffers on the device."""

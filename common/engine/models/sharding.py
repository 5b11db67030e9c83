"""A model's tensor-parallel plan, and the checkpoint cut to one rank's share by it.

A family names, per module (matched on the end of its dotted name, after the loader fused the packed
projections), how its weights split across ranks. The loader cuts the full checkpoint tensors with
`shard_state` before assigning them, so every rank holds only its share.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.parallel import TensorParallel


@dataclass(frozen=True)
class Colwise:
    """Output rows split across ranks. A fused module (q ‖ k ‖ v, gate ‖ up) lists its parts' full row counts,
    and each part is split on its own, so every rank holds its q heads ‖ its k heads ‖ its v heads."""

    parts: tuple[int, ...] = ()

    def cut(self, tensor: torch.Tensor, param: str, tp: TensorParallel) -> torch.Tensor:
        parts = tensor.split(list(self.parts)) if self.parts else (tensor,)
        return torch.cat([part.chunk(tp.size)[tp.rank] for part in parts])


@dataclass(frozen=True)
class Rowwise:
    """Input columns split; each rank's product is a partial sum that one all-reduce adds up. The bias is
    kept on rank 0 only (zeros elsewhere), so the sum counts it once."""

    def cut(self, tensor: torch.Tensor, param: str, tp: TensorParallel) -> torch.Tensor:
        if param == "bias":
            return tensor if tp.rank == 0 else torch.zeros_like(tensor)
        if param == "weight_scale" and tensor.shape[-1] == 1:  # an FP8 weight's row scale holds for every column
            return tensor
        return tensor.chunk(tp.size, dim=-1)[tp.rank]


@dataclass(frozen=True)
class VocabRows:
    """Vocabulary rows split in equal shares (TensorParallel.vocab_range), the last padded with zero rows."""

    vocab_size: int

    def cut(self, tensor: torch.Tensor, param: str, tp: TensorParallel) -> torch.Tensor:
        start, end = tp.vocab_range(self.vocab_size)
        rows = tensor[start:end]
        per = -(-self.vocab_size // tp.size)
        if len(rows) == per:
            return rows
        return torch.cat([rows, rows.new_zeros((per - len(rows), *rows.shape[1:]))])


@dataclass(frozen=True)
class ExpertColumns:
    """A MoE layer's stacked experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]): each expert's intermediate
    columns split as a dense MLP's are, its gate rows and its up rows Colwise, its down_proj columns Rowwise."""

    def cut(self, tensor: torch.Tensor, param: str, tp: TensorParallel) -> torch.Tensor:
        if param == "down_proj":
            return tensor.chunk(tp.size, dim=-1)[tp.rank]
        return torch.cat([part.chunk(tp.size, dim=1)[tp.rank] for part in tensor.chunk(2, dim=1)], dim=1)


Shard = Colwise | Rowwise | VocabRows | ExpertColumns


def _spec_of(module: str, plan: dict[str, Shard]) -> Shard | None:
    for name, spec in plan.items():
        if module == name or module.endswith("." + name):
            return spec
    return None


def shard_state(state: dict[str, torch.Tensor], plan: dict[str, Shard],
                tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's share of every checkpoint tensor (those of modules the plan does not name are kept whole)."""
    if tp.size == 1:
        return state
    out = {}
    for key, tensor in state.items():
        module, _, param = key.rpartition(".")
        spec = _spec_of(module, plan)
        out[key] = tensor if spec is None else _own(spec.cut(tensor, param, tp), tensor)
    return out


def _own(share: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The share in memory of its own: a cut that is a plain slice (a vocabulary's rows) would otherwise keep the
    whole tensor alive through its storage, every rank holding the full embedding and LM head."""
    if share.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr():
        return share.clone(memory_format=torch.contiguous_format)
    return share.contiguous()

"""--load-format dummy: a model's weights made on its device from config.json alone, as vLLM's dummy format.

Every floating-point tensor is uniform in [-1e-3, 1e-3] (small, so activations stay finite at any depth), drawn
from a generator seeded by (seed, the tensor's name): the same seed gives the same model. Each tensor is drawn
whole, at the unsharded model's shape, then cut to this rank's share by the family's own tensor-parallel plan, so
a model sharded over N ranks computes what the unsharded one does (and a rank holds one whole tensor at a time).
Generic over families: it walks the tensors the model declares, under the names the checkpoint path assigns
(packed projections already fused), so a new family needs nothing here.
"""
from __future__ import annotations

import torch
import xxhash
from transformers import PretrainedConfig

from common.engine.models.contract import CausalLM
from common.engine.models.registry import model_class
from common.engine.models.sharding import shard_state
from common.engine.parallel import SINGLE, TensorParallel

LOW, HIGH = -1e-3, 1e-3


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(xxhash.xxh64_intdigest(f"{seed}:{name}".encode()) & (2**63 - 1))
    return generator


def dummy_state(model: CausalLM, config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                tp: TensorParallel = SINGLE, seed: int = 0) -> dict[str, torch.Tensor]:
    """This rank's share of random weights for `model` (built on the meta device for `tp`), in `dtype` on `device`;
    the tensors it shares with another (tied_keys) are left out, as a checkpoint leaves them."""
    if tp.size == 1:
        whole = model
    else:
        with torch.device("meta"):
            whole = model_class(config)(config, SINGLE)
    state: dict[str, torch.Tensor] = {}
    for name, meta in whole.state_dict().items():
        if name in model.tied_keys:
            continue
        tensor = torch.empty(meta.shape, dtype=dtype if meta.is_floating_point() else meta.dtype, device=device)
        if tensor.is_floating_point():
            tensor.uniform_(LOW, HIGH, generator=_generator(seed, name, device))
        else:
            tensor.zero_()
        # shard_state gives each share memory of its own, so the whole tensor is freed once cut
        state.update(shard_state({name: tensor}, model.tp_plan(), tp) if tp.size > 1 else {name: tensor})
    return state

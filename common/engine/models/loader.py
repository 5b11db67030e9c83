"""Load any registered model family from a Hugging Face model directory, driven by its packed-module mapping."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from common.engine.models.checkpoint import load_config, load_state
from common.engine.models.contract import CausalLM
from common.engine.models.dummy import dummy_state
from common.engine.models.registry import model_class
from common.engine.models.sharding import shard_state
from common.engine.parallel import SINGLE, TensorParallel
from common.engine.quantization.fp8_checkpoint import Fp8Weights
from common.errors import InvalidConfig

__all__ = ["check_shardable", "fuse_projections", "load_config", "load_model", "load_state"]

# Checkpoint entries that are derived state, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def fuse_projections(state: dict[str, torch.Tensor], packed: dict[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """The checkpoint's parts of each packed module (e.g. q/k/v) concatenated, in order, into it (others kept)."""
    out = dict(state)
    for key in state:
        for fused, parts in packed.items():
            prefix, dot, param = key.rpartition(".")
            if not prefix.endswith("." + parts[0]):
                continue
            layer = prefix.removesuffix(parts[0])
            names = [f"{layer}{part}.{param}" for part in parts]
            if not all(n in out for n in names):
                continue  # an incomplete set: left for the strict key check to report
            out[f"{layer}{fused}.{param}"] = torch.cat([out.pop(n) for n in names], dim=0)
    return out


def _check_plan(model: CausalLM, tp: TensorParallel) -> None:
    if tp.size > 1 and not model.tp_plan():
        raise InvalidConfig(f"{type(model).__name__} has no tensor-parallel plan; run it with --tensor-parallel-size 1")


def check_shardable(model_dir: str | Path, tp_size: int) -> None:
    """InvalidConfig naming what `tp_size` ranks cannot split (heads, MLP columns, a family without a plan), found
    on the meta device before any rank starts or loads a weight."""
    if tp_size == 1:
        return
    config = load_config(model_dir)
    with torch.device("meta"):
        _check_plan(model_class(config)(config, TensorParallel(0, tp_size)), TensorParallel(0, tp_size))


def _checkpoint_state(model: CausalLM, model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                      tp: TensorParallel, fp8: Fp8Weights | None = None) -> dict[str, torch.Tensor]:
    """This rank's share of the checkpoint's tensors, under the model's parameter names, in `dtype` (with `fp8`:
    FP8 weights beside their scales)."""
    state = model.checkpoint_state(load_state(model_dir, device))
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES) and k not in model.tied_keys}
    packed = model.packed_modules_mapping
    state = fp8.read(state, dtype, model, packed) if fp8 else {k: v.to(dtype) for k, v in state.items()}
    return shard_state(fuse_projections(state, packed), model.tp_plan(), tp)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE,
               load_format: str = "auto", seed: int = 0,
               quantization: str | None = None) -> tuple[CausalLM, PretrainedConfig]:
    """The registered model for the checkpoint's architecture, its weights loaded (this rank's share of them
    under tensor parallelism), and its language config. load_format "dummy": random weights of `seed` instead,
    from config.json alone (models/dummy.py); no safetensors file is read. FP8 weights (an FP8 checkpoint, or
    `quantization` "fp8") load into Fp8Linear layers (common/engine/quantization)."""
    config = load_config(model_dir)
    with torch.device("meta"):
        model = model_class(config)(config, tp)
    _check_plan(model, tp)
    fp8 = Fp8Weights.of(config, quantization)
    if load_format == "dummy":
        state = dummy_state(model, config, dtype, device, tp, seed)
        state = fp8.quantize_made(model, state) if fp8 else state
    else:
        state = _checkpoint_state(model, model_dir, dtype, device, tp, fp8)
    if fp8:
        fp8.install(model, state, tp, device, dtype)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if k not in model.tied_keys]
    if missing or result.unexpected_keys:
        raise InvalidConfig(f"checkpoint in {model_dir} does not match the {config.model_type} model: "
                            f"missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")
    model.finish_loading(device)
    return model.eval(), model.config

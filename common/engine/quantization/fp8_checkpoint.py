"""FP8 checkpoints read into Fp8Linear's form (fp8_linear.py), and bf16/fp32 checkpoints quantised to it at load.

The checkpoint's config.json `quantization_config` names its format:
- Hugging Face FineGrainedFP8 (quant_method "fp8", DeepSeek-V3's): `X.weight` float8_e4m3fn and `X.weight_scale_inv`
  float32 [ceil(out / bn), ceil(in / bk)] for weight_block_size [bn, bk] (a scalar when it is null); despite its name
  the block's multiplier (transformers' Fp8Dequantize: weight * weight_scale_inv); `X.activation_scale` when the
  activation scheme is static.
- llm-compressor / compressed-tensors (quant_method "compressed-tensors", 8-bit "float" weights): `X.weight`
  float8_e4m3fn and `X.weight_scale`: [1] (strategy tensor), [out, 1] (channel) or [ceil(out / bn), ceil(in / bk)]
  (block, block_structure [bn, bk]); `X.input_scale` for static activations; `self_attn.k_scale` / `v_scale` for a
  calibrated FP8 KV cache.
Activation and KV scales are dropped: activations are quantised per token at run time, and the FP8 KV cache uses a
scale of 1.0 (kv_cache.py). Only the checkpoint's FP8 tensors become Fp8Linear (transformers leaves lm_head, and
shapes its blocks do not tile, unquantised); a fused module (q ‖ k ‖ v) of FP8 and unquantised parts gets its FP8
parts dequantised, since one module has one kind of weight.
`--quantization fp8` quantises every linear layer but lm_head of an unquantised checkpoint, one scale per output
row (what vLLM's fp8 does to a bf16 checkpoint), from the checkpoint's own precision.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from common.engine.config import QUANTIZATIONS
from common.engine.parallel import TensorParallel
from common.engine.quantization.fp8_linear import FP8, Fp8Linear, dequantize, quantize_rows
from common.errors import InvalidConfig

FP8_METHODS = ("fp8", "compressed-tensors")  # quantization_config.quant_method values we read
_SCALES = ("weight_scale", "weight_scale_inv")
_UNQUANTIZED = ("lm_head", "gate")  # linear layers --quantization fp8 leaves in --dtype (_linear_names)
# Static activation and calibrated KV-cache scales: read, not used (module docstring).
_DROPPED = ("input_scale", "activation_scale", "output_scale", "k_scale", "v_scale", "q_scale", "prob_scale")


def _quant_dict(config: PretrainedConfig) -> dict | None:
    qc = getattr(config, "quantization_config", None)
    return qc if qc is None or isinstance(qc, dict) else qc.to_dict()


def _compressed_tensors_block(qc: dict) -> tuple[int, int] | None:
    weights = [group.get("weights") or {} for group in (qc.get("config_groups") or {}).values()]
    if not weights or any(w.get("type") != "float" or w.get("num_bits") != 8 for w in weights):
        raise InvalidConfig(f"this compressed-tensors checkpoint is not FP8 (weights: {weights}); only 8-bit float "
                            "weights are supported")
    blocks = {tuple(w["block_structure"]) for w in weights if w.get("strategy") == "block"}
    if len(blocks) > 1:
        raise InvalidConfig(f"compressed-tensors groups with different FP8 blocks {sorted(blocks)} are not supported")
    return blocks.pop() if blocks else None


@dataclass(frozen=True)
class Fp8Weights:
    """How a checkpoint's weights become FP8: read as they are ("fp8", "compressed-tensors") or quantised ("load")."""

    source: str
    block: tuple[int, int] | None = None  # [rows, columns] of a block-wise scale

    @classmethod
    def of(cls, config: PretrainedConfig, quantization: str | None) -> "Fp8Weights | None":
        """From the checkpoint's quantization_config, else --quantization; None: weights as the checkpoint has them."""
        if quantization not in (None, *QUANTIZATIONS):
            raise InvalidConfig(f"--quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
        qc = _quant_dict(config)
        if qc is None:
            return cls("load") if quantization == "fp8" else None
        method = qc.get("quant_method")
        if method == "fp8":
            if qc.get("scale_fmt", "float") != "float":
                raise InvalidConfig(f"FP8 scales stored as {qc['scale_fmt']!r} are not supported (float32 only)")
            block = qc.get("weight_block_size")
            return cls("fp8", tuple(block) if block else None)
        if method == "compressed-tensors":
            return cls("compressed-tensors", _compressed_tensors_block(qc))
        raise InvalidConfig(f"checkpoint quantization {method!r} is not supported; FP8 checkpoints "
                            f"({', '.join(FP8_METHODS)}) and --quantization fp8 are")

    def read(self, state: dict[str, torch.Tensor], dtype: torch.dtype, model: nn.Module,
             packed: dict[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
        """The checkpoint (under the model's names, unfused) with every FP8 weight beside its `weight_scale`
        [out, columns], everything else in `dtype`."""
        if self.source == "load":
            state = _quantized(state, _linear_names(model, packed))
        fp8 = {k.removesuffix(".weight") for k, v in state.items() if k.endswith(".weight") and v.dtype == FP8}
        out = {}
        for key, tensor in state.items():
            module, _, param = key.rpartition(".")
            if module in fp8 and param == "weight":
                out[key], out[f"{module}.weight_scale"] = tensor, self._row_scales(state, module, tensor)
            elif tensor.dtype == FP8:
                raise InvalidConfig(f"{key} is FP8 but not a linear layer's weight; FP8 loads into linear layers "
                                    "only (not MoE experts' stacked weights)")
            elif param not in _SCALES + _DROPPED:
                out[key] = tensor.to(dtype)
        return self._unmixed(out, packed, dtype)

    @staticmethod
    def quantize_made(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Weights made without a checkpoint (--load-format dummy; fused, this rank's share) quantised as
        --quantization fp8 quantises a checkpoint's, whatever FP8 format the config names."""
        return _quantized(state, _linear_names(model, {}))

    def _row_scales(self, state: dict[str, torch.Tensor], module: str, weight: torch.Tensor) -> torch.Tensor:
        rows, cols = weight.shape
        scale = next((state[f"{module}.{s}"] for s in _SCALES if f"{module}.{s}" in state), None)
        if scale is None:
            raise InvalidConfig(f"{module}.weight is float8 but the checkpoint has no {' or '.join(_SCALES)} for it")
        scale = scale.float()
        if scale.numel() == 1:  # per tensor
            return scale.reshape(1, 1).expand(rows, 1).contiguous()
        if tuple(scale.shape) in ((rows,), (rows, 1)):  # per channel
            return scale.reshape(rows, 1)
        grid = None if self.block is None else (-(-rows // self.block[0]), -(-cols // self.block[1]))
        if tuple(scale.shape) != grid:
            raise InvalidConfig(f"{module}: a scale of shape {list(scale.shape)} fits neither a tensor, its {rows} "
                                f"rows nor blocks {self.block} of its [{rows}, {cols}] weight")
        return scale.repeat_interleave(self.block[0], dim=0)[:rows].contiguous()

    def _block_k(self, scale: torch.Tensor) -> int | None:
        return None if scale.shape[1] == 1 else self.block[1]

    def _unmixed(self, state: dict[str, torch.Tensor], packed: dict[str, tuple[str, ...]],
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Fused groups whose parts are not all FP8 with their FP8 parts dequantised to `dtype`."""
        for parts in packed.values():
            for key in [k for k in state if k.endswith(f".{parts[0]}.weight")]:
                layer = key.removesuffix(f"{parts[0]}.weight")
                scales = [f"{layer}{part}.weight_scale" for part in parts]
                if all(s in state for s in scales) or not any(s in state for s in scales):
                    continue
                for part, scale_key in zip(parts, scales):
                    if scale_key in state:
                        scale = state.pop(scale_key)
                        weight_key = f"{layer}{part}.weight"
                        state[weight_key] = dequantize(state[weight_key], scale, self._block_k(scale), dtype)
        return state

    def install(self, model: nn.Module, state: dict[str, torch.Tensor], tp: TensorParallel,
                device: torch.device, dtype: torch.dtype) -> None:
        """Swap each linear layer with FP8 weights in `state` (this rank's share) for an Fp8Linear on the meta device,
        for the loader to assign; where the weights are not held as FP8 (`holds_fp8`), dequantise them in `state`
        instead, for the plain linear layers."""
        keep = holds_fp8(device)
        for key in [k for k in state if k.endswith(".weight_scale")]:
            name = key.removesuffix(".weight_scale")
            old, scale, cols = model.get_submodule(name), state[key], state[f"{name}.weight"].shape[1]
            if not isinstance(old, nn.Linear):
                raise InvalidConfig(f"{name} has FP8 weights in the checkpoint but is not a linear layer of the model")
            block_k = self._block_k(scale)
            if block_k is not None and (scale.shape[1] != -(-cols // block_k) or (tp.size > 1 and cols % block_k)):
                raise InvalidConfig(f"{name}: its FP8 scales of blocks of {block_k} columns do not tile its {cols} "
                                    f"columns on each of {tp.size} tensor-parallel ranks")
            if not keep:
                state[f"{name}.weight"] = dequantize(state[f"{name}.weight"], state.pop(key), block_k, dtype)
                continue
            parent, _, child = name.rpartition(".")
            with torch.device("meta"):
                new = Fp8Linear(old.in_features, old.out_features, old.bias is not None, scale.shape[1], block_k)
            setattr(model.get_submodule(parent), child, new)


def holds_fp8(device: torch.device) -> bool:
    """Whether FP8 weights stay FP8 in memory on `device` (Fp8Linear), or are dequantised once at load. The CPU
    dequantises them: torch converts float8 there element by element, taking far longer than the bf16 GEMV that
    reads the weight, so dequantising on every call makes a decode step many times slower (benchmarks/fp8.py);
    dequantised once, it runs as bf16 does, in bf16's memory. A GPU converts at its memory's speed: it keeps them FP8.
    """
    return device.type != "cpu"


def _linear_names(model: nn.Module, packed: dict[str, tuple[str, ...]]) -> set[str]:
    """The checkpoint modules of the model's linear layers (a fused one's parts) but lm_head and a MoE layer's
    router (`gate`), which vLLM's fp8 leaves unquantised too: an expert choice should not flip on FP8 rounding."""
    names = set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.rpartition(".")[2] in _UNQUANTIZED:
            continue
        fused = next((f for f in packed if name == f or name.endswith("." + f)), None)
        if fused is None:
            names.add(name)
        else:
            names.update(name.removesuffix(fused) + part for part in packed[fused])
    return names


def _quantized(state: dict[str, torch.Tensor], linears: set[str]) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in state.items():
        module, _, param = key.rpartition(".")
        if module in linears and param == "weight":
            out[key], out[f"{module}.weight_scale"] = quantize_rows(tensor)
        else:
            out[key] = tensor
    return out

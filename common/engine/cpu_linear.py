"""Linear layers on the CPU through oneDNN, with their weights packed once (the layout its GEMM reads).

torch's nn.Linear on the CPU calls MKL (float32) or oneDNN with the plain [out, in] weight, reordered on every
call (bfloat16). Packed once at load, a forward's GEMMs skip that reorder: for the few rows of a decode step they
take a little over half the plain bf16 time (the reorder costs as much as the product), and they stay ahead, by
less, at prompt sizes. The packed GEMM gives the same bf16 values as the plain one (both oneDNN). Float32 stays
on MKL, the arithmetic Hugging Face's float32 reference runs, so greedy tokens stay equal to it.
"""
from __future__ import annotations

import torch
from torch import nn

from common.engine import cpu_gemv, cpu_helper


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `pack_linears` applies: bfloat16 on a CPU whose oneDNN has bf16 GEMMs (avx512_bf16 or AMX)."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class _PackedForward:
    """nn.Linear.forward on the packed weight (the module keeps its own weight: a tied embedding reads it)."""

    def __init__(self, layer: nn.Linear):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 1)
        self.bias = None if layer.bias is None else layer.bias.detach()
        self.plain = layer.weight.detach().contiguous()  # [out, in], the layout cpu_gemv reads (the module's own)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # a step's [tokens, in] as it is: its two reshapes took ~4.5 us a call, 121 calls a step
            if cpu_gemv.applies(x):  # a decode step of one sequence: its rows shared with an idle helper core
                return cpu_gemv.gemv(self.plain, self.bias, x)
            if cpu_helper.applies(x):  # a prefill chunk: half its rows on an idle helper core
                return cpu_helper.helper().split(self._rows, x)
            return self._rows(x)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Give every nn.Linear of `model` a packed forward; returns how many (call after the weights are loaded)."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for layer in layers:
        layer.forward = _PackedForward(layer)
    return len(layers)

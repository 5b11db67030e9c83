"""The sparse mixture-of-experts block: a router picks each token's top-k experts, each expert is a gated MLP
(silu(gate) · up → down), and the token's output is the routing-weighted sum of its experts' outputs.

Experts are held as Hugging Face stores them in memory (transformers ≥ 5): `experts.gate_up_proj` [E, 2I, H]
(each expert's gate ‖ up rows) and `experts.down_proj` [E, H, I]; the router is `gate` [E, H], whole on every rank.
Under tensor parallelism each expert's intermediate columns split across ranks as a dense MLP's do
(sharding.ExpertColumns), and the block ends in the same one all-reduce.

Three ways to run the experts, the same sums:
- `looped_experts` (the CPU, the reference): sort the (token, expert) pairs by expert, one GEMM pair per expert that
  got tokens; it reads the counts on the host.
- `grouped_experts` (CUDA, bf16): the pairs sorted by expert feed two grouped GEMMs (`torch._grouped_mm`) whose
  group boundaries stay on the device, so a decode step is CUDA-graph capturable.
- `dense_experts`: every expert on every row, the unrouted weighted 0; only while a CUDA graph captures a step
  that grouped GEMM cannot run (float32), as it needs no host sync.
On CUDA the whole block after the router's GEMM may instead run as Triton kernels (kernels/fused_moe.py: routing,
the expert-sorted layout, two grouped GEMMs, the top-k sum), where they measured no slower than the torch path for
the step's token count.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.kernels import HAS_TRITON, silu_and_mul
from common.engine.parallel import TensorParallel


@dataclass(frozen=True)
class MoeSpec:
    """One family's sparse block: experts, experts per token, each expert's intermediate size, and whether the
    top-k probabilities (softmax over every expert) are renormalised to sum to 1 (Mixtral: always, which is the
    softmax over the top-k logits; Qwen3-MoE: `norm_topk_prob`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights [T, k], expert ids [T, k]) of router logits [T, E], as transformers' routers give them."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _combine(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows [T·k, H] in expert order back to token order, each weighted, summed over a token's k experts."""
    T, k = weights.shape
    unsorted = torch.empty_like(rows)
    unsorted[order] = rows
    return (unsorted.view(T, k, -1).float() * weights[..., None]).sum(dim=1).to(dtype)


def looped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """The torch reference: x [T, H] through experts gate_up [E, 2I, H] / down [E, H, I] chosen by ids [T, k]."""
    k = ids.shape[1]
    order = ids.flatten().argsort(stable=True)
    tokens = order // k
    counts = torch.bincount(ids.flatten(), minlength=gate_up.shape[0]).tolist()
    rows = x.new_empty(len(order), x.shape[1])
    start = 0
    for expert, n in enumerate(counts):
        if n:
            part = slice(start, start + n)
            rows[part] = F.linear(silu_and_mul(F.linear(x[tokens[part]], gate_up[expert])), down[expert])
            start += n
    return _combine(rows, order, weights, x.dtype)


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """The same sums through two grouped GEMMs over the pairs sorted by expert; no host sync."""
    k, num_experts = ids.shape[1], gate_up.shape[0]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)
    h = torch._grouped_mm(x[order // k], gate_up.transpose(1, 2), offs=offsets)
    rows = torch._grouped_mm(silu_and_mul(h), down.transpose(1, 2), offs=offsets)
    return _combine(rows, order, weights, x.dtype)


def dense_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """Every expert on every row ([E, T, ·] intermediates), weighted by a [T, E] matrix zero off the routed ones."""
    mix = torch.zeros(x.shape[0], gate_up.shape[0], device=x.device).scatter_(1, ids, weights)
    out = torch.matmul(silu_and_mul(torch.matmul(x, gate_up.transpose(1, 2))), down.transpose(1, 2))
    return torch.einsum("eth,te->th", out.float(), mix).to(x.dtype)


# torch's grouped GEMM on CUDA: sm90 only in torch 2.8, sm80+ from 2.9.
_GROUPED_MIN_CAPABILITY = (8, 0) if tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 9) else (9, 0)


@cache
def _has_grouped_gemm(device: torch.device) -> bool:
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device) >= _GROUPED_MIN_CAPABILITY


def _grouped_applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """torch's grouped GEMM on CUDA takes bf16, with rows a multiple of 16 bytes."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.shape[-1] % 8 == 0 and down.shape[-1] % 8 == 0
            and _has_grouped_gemm(x.device))


def run_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    if _grouped_applies(x, gate_up, down):
        return grouped_experts(x, gate_up, down, ids, weights)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return dense_experts(x, gate_up, down, ids, weights)
    return looped_experts(x, gate_up, down, ids, weights)


@cache
def _fused():
    from common.engine.kernels import fused_moe

    return fused_moe


def torch_moe(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
              renormalize: bool) -> torch.Tensor:
    """The sparse block after the router's GEMM in torch ops (fused_moe.fused_moe's signature): route, run_experts."""
    weights, ids = route(logits, top_k, renormalize)
    return run_experts(x, gate_up, down, ids, weights)


def _fused_applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, spec: MoeSpec) -> bool:
    """CUDA with triton, and the Triton path measured no slower than torch_moe (fused_moe.applies)."""
    if not (x.is_cuda and HAS_TRITON):
        return False
    fused = _fused()

    def timed(block):  # as fused_moe.applies times a path: a function of (x, router logits)
        return lambda h, logits: block(h, logits, gate_up, down, spec.top_k, spec.renormalize)

    return fused.applies(x, gate_up, down, spec.top_k, (timed(fused.fused_moe), timed(torch_moe)))


class Experts(nn.Module):
    def __init__(self, spec: MoeSpec, hidden_size: int, tp: TensorParallel):
        super().__init__()
        intermediate = tp.split(spec.intermediate_size, "expert MLP columns (moe intermediate size)")
        self.gate_up_proj = nn.Parameter(torch.empty(spec.num_experts, 2 * intermediate, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(spec.num_experts, hidden_size, intermediate))


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: MoeSpec, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.spec = spec
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec, hidden_size, tp)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (after the post-attention norm) → this rank's partial sum, all-reduced."""
        logits, spec = self.gate(x), self.spec
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        block = _fused().fused_moe if _fused_applies(x, gate_up, down, spec) else torch_moe
        return self.tp.all_reduce(block(x, logits, gate_up, down, spec.top_k, spec.renormalize))

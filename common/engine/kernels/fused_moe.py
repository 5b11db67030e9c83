"""The sparse MoE block's experts as four Triton kernels, on CUDA (models/moe.py holds the torch paths).

vLLM's fused_moe shape, written for our weights (`gate_up` [E, 2I, H], `down` [E, H, I]):
1. `route`: one program a token: softmax over the router logits, top-k by repeated argmax, the family's
   renormalisation (models/moe.route's arithmetic);
2. `align`: one program an expert lays out the (token, expert) pairs it got, in pair order, from the start of its
   own slot of the expert-sorted list, each slot padded to BLOCK_M with the sentinel P (= T·k, the pair count),
   and names itself as the expert of its blocks. Every shape is a function of T alone (the list is as long as the
   worst case), and the blocks past the used length are skipped by the GEMMs: no host sync, CUDA-graph capturable;
3. two grouped GEMMs over those blocks, each program a BLOCK_M × BLOCK_N tile of one expert: gate_up with
   silu(gate) · up fused into its epilogue (it accumulates the gate and the up columns side by side), writing a
   row per pair; down, each row multiplied by its pair's routing weight (after the product, as transformers
   weighs the expert's output);
4. a sum over each token's k rows in float32 (a small kernel: torch's reduction took twice as long at one token).
Both GEMMs round to the model dtype where the torch path's separate ops do (the product, silu, silu · up), so a
bf16 result differs from it only by summation order.

`applies` picks this path or the torch one per (T bucket, shapes) by timing both inside a CUDA graph at first use,
as gemv.py picks the GEMV; `IMPL` forces either (the bench's --moe-impl).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from common.engine.kernels.gemv import graph_time_us
from common.engine.kernels.triton_ops import _round

IMPLS = ("auto", "torch", "triton")
IMPL = "auto"  # "torch" / "triton" force one path on CUDA (benches); "auto" times both at first use


@dataclass(frozen=True)
class MoeTile:
    block_m: int
    block_n: int  # gate_up: columns of the gate (and as many of up) a program computes
    block_k: int
    down_block_n: int
    num_warps: int = 4
    num_stages: int = 3


def tile_for(pairs_per_expert: float) -> MoeTile:
    """Few rows an expert (decode): the smallest MMA tile and narrow columns, so that the few experts hit still
    spread over every SM; many rows (prefill): the wide tiles of a compute-bound GEMM."""
    if pairs_per_expert <= 16:
        return MoeTile(16, 32, 128, 64, 4, 4)
    if pairs_per_expert <= 64:
        return MoeTile(32, 64, 64, 128, 4, 3)
    return MoeTile(64, 64, 64, 128, 8, 3)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=-float("inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    probs = tl.where(e < E, probs, -1.0)
    j = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], tl.float32)
    top_i = tl.zeros([K_PAD], tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=0)
        top_w = tl.where(j == i, tl.max(probs, axis=0), top_w)
        top_i = tl.where(j == i, best, top_i)
        probs = tl.where(e == best, -1.0, probs)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(weights_ptr + t * TOP_K + j, top_w, mask=j < TOP_K)
    tl.store(ids_ptr + t * TOP_K + j, top_i, mask=j < TOP_K)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights [T, k], int32 expert ids [T, k]) of router logits [T, E]: models/moe.route in one kernel."""
    T, E = logits.shape
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    if T:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _route_kernel[(T,)](logits, weights, ids, E, logits.stride(0), TOP_K=top_k,
                            K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                            BLOCK_E=triton.next_power_of_2(E), num_warps=1 if E <= 256 else 4)
    return weights, ids


ALIGN_CHUNK = 1024


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, used_ptr, P, BLOCK_M: tl.constexpr,
                  BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Program e: every expert's pair count (a histogram of the ids), its slot's start (the padded counts of the
    experts before it), then its own pairs' indices in pair order, its padding, and its blocks' expert id."""
    e = tl.program_id(0)
    bins = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, P, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        counts += tl.histogram(tl.load(ids_ptr + offs, mask=offs < P, other=0), BLOCK_E, mask=offs < P)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    slot = tl.sum(tl.where(bins < e, padded, 0), axis=0)
    count = tl.sum(tl.where(bins == e, counts, 0), axis=0)
    if e == 0:
        tl.store(used_ptr, tl.sum(padded, axis=0))
    if count > 0:
        seen = 0
        for start in range(0, P, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            mine = (tl.load(ids_ptr + offs, mask=offs < P, other=-1) == e).to(tl.int32)
            tl.store(sorted_ptr + slot + seen + tl.cumsum(mine, axis=0) - 1, offs, mask=mine != 0)
            seen += tl.sum(mine, axis=0)
        pad = count + tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + slot + pad, P, mask=pad < (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
        for block in range(slot // BLOCK_M, (slot + count + BLOCK_M - 1) // BLOCK_M):
            tl.store(block_expert_ptr + block, e)


@dataclass(frozen=True)
class Alignment:
    """The expert-sorted pairs: `pairs` [capacity] pair indices (P where padding), `block_expert` [capacity /
    BLOCK_M] the expert of each block, `used` [1] how many leading entries hold the sorted list."""

    pairs: torch.Tensor
    block_expert: torch.Tensor
    used: torch.Tensor
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


def capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The longest the padded list can be: every pair, plus BLOCK_M - 1 of padding for each expert that can get
    one (no more of them than pairs), rounded to whole blocks."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-worst // block_m) * block_m


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """ids [T, k] (any integer dtype) → the pairs sorted by expert, each expert's run padded to block_m."""
    P, dev = ids.numel(), ids.device
    cap = capacity(P, num_experts, block_m)
    pairs = torch.empty(cap, dtype=torch.int32, device=dev)
    block_expert = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    used = torch.empty(1, dtype=torch.int32, device=dev)
    _align_kernel[(num_experts,)](ids.reshape(-1), pairs, block_expert, used, P, BLOCK_M=block_m,
                                  BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=ALIGN_CHUNK, num_warps=4)
    return Alignment(pairs, block_expert, used, block_m)


@triton.jit
def _expert_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, pairs_ptr, block_expert_ptr, used_ptr, N, K, P,
                        stride_am, stride_be, stride_bn, stride_cm, A_ROW_DIV: tl.constexpr,
                        SILU_MUL: tl.constexpr, WEIGHTED: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[pair, n] = A[pair // A_ROW_DIV] · B[expert, n] over one block of one expert's pairs. SILU_MUL: B holds
    2N rows (gate ‖ up) and C gets silu(gate) · up; WEIGHTED: each row times its pair's routing weight."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    pid_n = tl.program_id(1)
    dtype = c_ptr.dtype.element_ty
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < P
    rows = tl.where(valid, pairs // A_ROW_DIV, 0).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = n % N  # past the last column: a real row is read, its result not stored
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + k[None, :]
    b_ptrs = b_ptr + expert * stride_be + n_in[None, :].to(tl.int64) * stride_bn + k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
            b = tl.load(b_ptrs + k0)
        else:
            k_in = k < K - k0
            a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_in[None, :], other=0.0)
            b = tl.load(b_ptrs + k0, mask=k_in[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if SILU_MUL:
            if EVEN_K:
                b_up = tl.load(b_ptrs + N * stride_bn + k0)
            else:
                b_up = tl.load(b_ptrs + N * stride_bn + k0, mask=k_in[:, None], other=0.0)
            if IEEE:
                acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up, acc_up)
    out = _round(acc, dtype)
    if SILU_MUL:
        out = _round(_round(out / (1.0 + tl.exp(-out)), dtype) * _round(acc_up, dtype), dtype)
    if WEIGHTED:
        out = out * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + n[None, :]
    tl.store(c_ptrs, out.to(dtype), mask=valid[:, None] & (n < N)[None, :])


def _expert_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, layout: Alignment, weights: torch.Tensor | None,
                 row_div: int, silu_mul: bool, block_n: int, tile: MoeTile) -> None:
    n, k = out.shape[1], b.shape[2]
    _expert_gemm_kernel[(layout.num_blocks, triton.cdiv(n, block_n))](
        a, b, out, weights if weights is not None else a, layout.pairs, layout.block_expert, layout.used, n, k,
        out.shape[0], a.stride(0), b.stride(0), b.stride(1), out.stride(0), A_ROW_DIV=row_div, SILU_MUL=silu_mul,
        WEIGHTED=weights is not None, EVEN_K=k % tile.block_k == 0, IEEE=a.dtype == torch.float32,
        BLOCK_M=tile.block_m, BLOCK_N=block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps,
        num_stages=tile.num_stages)


SUM_BLOCK = 1024


@triton.jit
def _sum_topk_kernel(rows_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (t * TOP_K + j) * H + h, mask=h < H, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=h < H)


def sum_topk(rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """rows [T·k, H] (each token's k rows together) → [T, H], summed in float32."""
    H = rows.shape[1]
    out = torch.empty((rows.shape[0] // top_k, H), dtype=rows.dtype, device=rows.device)
    _sum_topk_kernel[(out.shape[0], triton.cdiv(H, SUM_BLOCK))](rows, out, H, TOP_K=top_k, BLOCK=SUM_BLOCK)
    return out


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, tile: MoeTile | None = None) -> torch.Tensor:
    """x [T, H] through experts gate_up [E, 2I, H] / down [E, H, I] chosen by ids [T, k], weighted by weights
    [T, k] (float32): models/moe.looped_experts' sums."""
    T, H = x.shape
    E, k, inter = gate_up.shape[0], ids.shape[1], down.shape[2]
    if T == 0:
        return x.new_zeros(0, H)
    tile = tile or tile_for(T * k / E)
    x = x if x.stride(-1) == 1 else x.contiguous()
    layout = align(ids, E, tile.block_m)
    h = torch.empty((T * k, inter), dtype=x.dtype, device=x.device)
    _expert_gemm(x, gate_up, h, layout, None, k, True, tile.block_n, tile)
    rows = torch.empty((T * k, H), dtype=x.dtype, device=x.device)
    _expert_gemm(h, down, rows, layout, weights.reshape(-1).float(), 1, False, tile.down_block_n, tile)
    return sum_topk(rows, k)


def fused_moe(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
              renormalize: bool) -> torch.Tensor:
    """The whole sparse block after the router's GEMM: routing, alignment, both expert GEMMs, the top-k sum."""
    weights, ids = route(logits, top_k, renormalize)
    return fused_experts(x, gate_up, down, ids, weights)


@dataclass(frozen=True)
class MoeChoice:
    """µs per sparse block (routing included) inside a CUDA graph, measured by `applies`."""

    fused_us: float
    torch_us: float

    @property
    def uses_fused(self) -> bool:
        return self.fused_us <= self.torch_us


choices: dict[tuple, MoeChoice] = {}
TimedPath = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, router logits) -> the block's output


def fits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    return (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and gate_up.dtype == down.dtype == x.dtype and gate_up.stride(-1) == 1 and down.stride(-1) == 1)


def bucket(tokens: int) -> int:
    return 1 << max(0, tokens - 1).bit_length()


def applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
            paths: tuple[TimedPath, TimedPath]) -> bool:
    """Whether this path runs the block for x: forced by IMPL, else whether it measured no slower than the torch
    path, for x's token count rounded up to a power of 2 (measured once, outside any CUDA-graph capture; a key
    first met inside one takes the torch path). paths: (this, torch) as functions of (x, logits)."""
    if not fits(x, gate_up, down) or IMPL == "torch":
        return False
    if IMPL == "triton":
        return True
    key = (bucket(x.shape[0]), *gate_up.shape, down.shape[1], top_k, x.dtype, x.device)
    if key not in choices:
        if torch.cuda.is_current_stream_capturing():
            return False
        choices[key] = MoeChoice(*(time_path(p, key[0], x, gate_up.shape[0]) for p in paths))
    return choices[key].uses_fused


def time_path(path: TimedPath, tokens: int, like: torch.Tensor, num_experts: int, calls: int = 8) -> float:
    """µs per call of path over `tokens` random rows, each call with its own random router logits (so calls pick
    different experts, whose weights are then not in the L2), inside one CUDA graph."""
    gen = torch.Generator(like.device).manual_seed(0)
    x = torch.randn((tokens, like.shape[1]), generator=gen, device=like.device).to(like.dtype)
    logits = [torch.randn((tokens, num_experts), generator=gen, device=like.device).to(like.dtype)
              for _ in range(calls)]
    return graph_time_us(lambda i: path(x, logits[i]), calls)

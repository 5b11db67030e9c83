"""Paged attention over the block-structured KV cache.

The KV cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V).
A request owns a block table (block ids); token at position p lives in
block `block_table[p // block_size]`, offset `p % block_size`.

`TorchPagedAttention` is the reference that runs everywhere (CPU included): it gathers each
request's blocks and calls scaled_dot_product_attention. A GPU kernel implements the same
two methods (`prepare`, `forward`) and is chosen in model_runner.make_attention_backend.

On the CPU it is also the serving path, so each choice is the faster way: decodes read the blocks in place with a C
kernel (cpu_attention.py), and so do prefill chunks, over their cached context and themselves (no gather, no SDPA
call); where they are not built, blocks are gathered whole with `index_select` on the block ids, several times
faster than indexing by table; and bf16/fp16 attention runs in float32 (torch's CPU flash kernel is slower in bf16,
most of all for decodes).
An FP8 cache (quantization/kv_cache.py) is read the same ways: by the C kernel, each byte's value from a table, or
gathered and dequantised to the compute dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.engine import cpu_attention
from common.engine.quantization.kv_cache import KvCacheFormat


@dataclass
class BatchLayout:
    """The per-step batch, as plain lists, from which a backend builds its metadata."""

    query_lens: list[int]
    context_lens: list[int]  # tokens already in the cache before this step
    block_tables: list[list[int]]

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]


@dataclass
class _PrefillSeq:
    token_slice: slice
    block_ids: torch.Tensor
    seq_len: int
    masks: dict[int | None, torch.Tensor]  # sliding window (None = full) -> [q, seq_len] bool


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    decode_token_idx: torch.Tensor  # [num_decodes] rows of the packed batch that are 1-token queries
    decode_block_ids: torch.Tensor  # [num_decodes * max_blocks]: each decode's blocks, zero-padded to max_blocks
    decode_masks: dict[int | None, torch.Tensor]  # [num_decodes, 1, 1, max_kv] bool
    decode_seq_lens: torch.Tensor  # [num_decodes] int64: tokens each decode attends to, its own included
    decode_starts: dict[int | None, torch.Tensor]  # sliding window -> [num_decodes] first token in it
    prefills: list[_PrefillSeq] = field(default_factory=list)
    # the prefills again for the C kernel, each [num_prefills] int64 (block ids [num_prefills * max_blocks])
    prefill_rows: torch.Tensor | None = None  # first row of each in the packed batch
    prefill_query_lens: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    prefill_block_ids: torch.Tensor | None = None  # zero-padded to the longest's blocks


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal mask, optionally limited to a sliding window, as Hugging Face defines it."""
    ok = (k_pos <= q_pos) & (k_pos < seq_len)
    if window is not None:
        ok &= (q_pos - k_pos) < window
    return ok


class TorchPagedAttention:
    """Reference paged attention: gathers blocks, then SDPA. Decodes are batched; prefills run one by one."""

    # The model applies RoPE and calls `forward`, which writes K/V; or, where kernels.rope_store_on_cpu, one C kernel
    # ropes and writes them and the model calls `attend`.
    fused_rope_store = False
    graphable = False  # no `host_arrays`: decode steps are not captured in CUDA graphs

    def __init__(self, block_size: int, windows: set[int | None], device: torch.device,
                 kv: KvCacheFormat | None = None):
        self.block_size = block_size
        self.windows = windows
        self.device = device
        self.kv = kv or KvCacheFormat(torch.float32)  # None: a cache of the compute dtype, nothing to convert

    def prepare(self, layout: BatchLayout) -> TorchAttentionMetadata:
        bs, dev = self.block_size, self.device
        slots: list[int] = []
        for ctx, q, table in zip(layout.context_lens, layout.query_lens, layout.block_tables):
            slots.extend(table[p // bs] * bs + p % bs for p in range(ctx, ctx + q))
        meta_decode_rows, decode_tables, decode_lens = [], [], []
        prefills: list[_PrefillSeq] = []
        prefill_rows, prefill_lens, prefill_ctx, prefill_tables = [], [], [], []
        start = 0
        for ctx, q, table in zip(layout.context_lens, layout.query_lens, layout.block_tables):
            seq_len = ctx + q
            needed = table[: (seq_len + bs - 1) // bs]
            if q == 1:
                meta_decode_rows.append(start)
                decode_tables.append(needed)
                decode_lens.append(seq_len)
            else:
                q_pos = torch.arange(ctx, seq_len, device=dev)[:, None]
                k_pos = torch.arange(seq_len, device=dev)[None, :]
                masks = {w: _allowed(q_pos, k_pos, torch.tensor(seq_len, device=dev), w) for w in self.windows}
                prefills.append(_PrefillSeq(slice(start, start + q), torch.tensor(needed, device=dev), seq_len, masks))
                prefill_rows.append(start)
                prefill_lens.append(q)
                prefill_ctx.append(ctx)
                prefill_tables.append(needed)
            start += q
        max_blocks = max((len(t) for t in decode_tables), default=0)
        block_ids = _padded(decode_tables)
        lens = torch.tensor(decode_lens, dtype=torch.long, device=dev)
        k_pos = torch.arange(max_blocks * bs, device=dev)[None, :]
        q_pos = (lens - 1)[:, None]
        decode_masks = {w: _allowed(q_pos, k_pos, lens[:, None], w)[:, None, None, :] for w in self.windows}
        return TorchAttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decode_token_idx=torch.tensor(meta_decode_rows, dtype=torch.long, device=dev),
            decode_block_ids=torch.tensor(block_ids, dtype=torch.long, device=dev),
            decode_masks=decode_masks,
            decode_seq_lens=lens,
            decode_starts={w: (lens - w).clamp_(min=0) if w else torch.zeros_like(lens) for w in self.windows},
            prefills=prefills,
            **({} if dev.type != "cpu" else dict(  # the C prefill kernel's, on the CPU only
                prefill_rows=torch.tensor(prefill_rows, dtype=torch.long),
                prefill_query_lens=torch.tensor(prefill_lens, dtype=torch.long),
                prefill_context_lens=torch.tensor(prefill_ctx, dtype=torch.long),
                prefill_block_ids=torch.tensor(_padded(prefill_tables), dtype=torch.long))),
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, N, bs, Hkv, D]
        meta: TorchAttentionMetadata,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
        self.kv.write(k_cache.view(-1, num_kv_heads, head_dim), meta.slot_mapping, k)
        self.kv.write(v_cache.view(-1, num_kv_heads, head_dim), meta.slot_mapping, v)
        return self.attend(q, kv_cache, meta, scale, window)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: TorchAttentionMetadata, scale: float,
               window: int | None) -> torch.Tensor:
        """`forward` after its K/V write: the step's K and V are in the cache already (kernels.rope_store_kv wrote
        them, on the CPU in bf16)."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if not meta.prefills:  # every row a decode, in order
            return self._decode(q, k_cache, v_cache, meta, scale, window)
        kernel = cpu_attention.prefill_applies(q, k_cache)
        if kernel:
            q = q.contiguous()  # the kernel's layout, and so out's
        out = torch.empty_like(q)
        if meta.decode_token_idx.numel():
            out[meta.decode_token_idx] = self._decode(q[meta.decode_token_idx], k_cache, v_cache, meta, scale, window)
        if kernel:  # every prefill in one call, straight from the blocks
            cpu_attention.prefill(q, out, k_cache, v_cache, meta.prefill_block_ids, meta.prefill_rows,
                                  meta.prefill_query_lens, meta.prefill_context_lens, scale, window, self.kv.scale)
            return out
        for seq in meta.prefills:
            keys = self.kv.read(k_cache.index_select(0, seq.block_ids).flatten(0, 1)[: seq.seq_len], q.dtype)
            values = self.kv.read(v_cache.index_select(0, seq.block_ids).flatten(0, 1)[: seq.seq_len], q.dtype)
            out[seq.token_slice] = _sdpa(q[seq.token_slice].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                         seq.masks[window], scale).squeeze(0)
        return out

    def _decode(self, q, k_cache, v_cache, meta, scale, window) -> torch.Tensor:
        if cpu_attention.applies(q, k_cache):  # straight from the blocks, no gathered copy
            return cpu_attention.decode(q, k_cache, v_cache, meta.decode_block_ids, meta.decode_seq_lens,
                                        meta.decode_starts[window], scale, self.kv.scale)
        shape = (q.shape[0], -1, *k_cache.shape[2:])  # [B, max_kv, Hkv, D]
        keys = self.kv.read(k_cache.index_select(0, meta.decode_block_ids).view(shape), q.dtype)
        values = self.kv.read(v_cache.index_select(0, meta.decode_block_ids).view(shape), q.dtype)
        return _sdpa(q.unsqueeze(1), keys, values, meta.decode_masks[window], scale).squeeze(1)


def _padded(tables: list[list[int]]) -> list[int]:
    """The block tables flattened, each zero-padded to the longest."""
    longest = max((len(t) for t in tables), default=0)
    return [b for t in tables for b in t + [0] * (longest - len(t))]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D], mask broadcastable to [B, H, Lq, Lk] → [B, Lq, Hq, D]."""
    dtype = q.dtype
    if q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):  # faster in float32 there (see above)
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2).to(dtype)

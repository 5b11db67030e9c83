"""Paged attention on the GPU: Triton kernels with the interface of the torch reference (`prepare`, `forward`).

Three kernels over the same cache layout as `TorchPagedAttention` (per layer `[2, N, bs, Hkv, D]`):
- `_store_kv`: writes each new token's K and V at its slot (slot < 0 = a padded row of a CUDA graph: skipped);
- `_decode`: one program per (sequence, KV head) computes the whole GQA group of query heads at once,
  streaming the sequence's blocks with an online softmax (flash-decoding without the split);
- `_prefill`: one program per (query head, tile of BLOCK_M query tokens of one sequence), causal over the
  cached context plus the new tokens, so chunked prefill and prefix-cache hits need no special case. Keys every
  query of the tile sees go through a loop without masks; only the diagonal's blocks (and a window's) compare
  positions. Tiles run longest first.
In a mixed step (prefill chunks beside decode rows) the decode rows take `_decode`, split over their context like a
decode-only step, each at its row of the packed batch (a row map): through `_prefill` each would be one program per
query head walking its whole context alone, with a BLOCK_M-row tile for its one query.
The cache may be FP8 (--kv-cache-dtype fp8, scale 1.0): stores convert to it, and the attention kernels convert each
loaded K / V tile to q's dtype.

All metadata is built on the host in `prepare` and copied with non-blocking pinned copies: the step loop
never waits on the GPU here. Decode-only batches keep fixed-shape metadata so a CUDA graph can replay them; other
steps' metadata takes a fixed shape with padding that does nothing (`StaticShape`) for the whole-step graphs.
Importing this module needs triton; model_runner.make_attention_backend only does so on a CUDA device.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import chain

import numpy as np
import torch
import triton
import triton.language as tl

from common.engine.host_upload import upload
from common.engine.attention import BatchLayout


@triton.jit
def _store_kv(k_ptr, v_ptr, k_cache, v_cache, slots, stride_kt, stride_vt, HD: tl.constexpr, HD_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    if slot >= 0:
        offs = tl.arange(0, HD_PAD)
        mask = offs < HD
        tl.store(k_cache + slot * HD + offs, tl.load(k_ptr + t * stride_kt + offs, mask=mask), mask=mask)
        tl.store(v_cache + slot * HD + offs, tl.load(v_ptr + t * stride_vt + offs, mask=mask), mask=mask)


@triton.jit
def _decode(q_ptr, k_cache, v_cache, out_ptr, part_acc, part_ml, block_tables, seq_lens, row_map, scale, window,
            stride_qt, stride_qh, stride_bt, stride_cb, stride_ct, stride_ch,
            GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
            BS: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, MAPPED: tl.constexpr):
    """MAPPED (a mixed step): sequence b's query and output are row `row_map[b]` of the packed batch, and an entry of
    length 0 (a whole-step graph's padding) stores nothing. Otherwise row b, and length 0 gives zeros."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    seq_len = tl.load(seq_lens + b)
    row = b
    if MAPPED:
        row = tl.load(row_map + b)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < D
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0) // BLOCK * BLOCK
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, SPLITS), BLOCK) * BLOCK  # flash-decoding: splits of the sequence
    s_lo = lo + split * per_split
    s_hi = tl.minimum(s_lo + per_split, seq_len)
    for n0 in range(s_lo, s_hi, BLOCK):
        pos = n0 + tl.arange(0, BLOCK)
        valid = pos < s_hi
        if window > 0:
            valid = valid & (pos > seq_len - 1 - window)
        blk = tl.load(block_tables + b * stride_bt + pos // BS, mask=valid, other=0)
        base = blk.to(tl.int64) * stride_cb + (pos % BS) * stride_ct + kvh * stride_ch
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_cache + base[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # an FP8 cache: read
        v = tl.load(v_cache + base[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # as q's dtype
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], (s * scale).to(tl.float32), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out_mask = gmask[:, None] & dmask[None, :]
    if SPLITS == 1:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padded rows (seq_len 0) give zeros, not NaN
        out = acc / l_i[:, None]
        if MAPPED:  # no head of an empty entry
            out_mask = (g < tl.where(seq_len > 0, GROUP, 0))[:, None] & dmask[None, :]
        tl.store(out_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # partial results [B, Hq, SPLITS, ...]; _merge_splits combines them
        row = (b * num_kv_heads * GROUP + heads) * SPLITS + split
        tl.store(part_acc + row[:, None] * D_PAD + d[None, :], acc, mask=out_mask)
        tl.store(part_ml + row * 2, m_i, mask=gmask)
        tl.store(part_ml + row * 2 + 1, l_i, mask=gmask)


@triton.jit
def _merge_splits(part_acc, part_ml, out_ptr, seq_lens, row_map, stride_qt, stride_qh, D: tl.constexpr,
                  D_PAD: tl.constexpr, SPLITS: tl.constexpr, MAPPED: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    out_row = b
    width = D  # elements stored
    if MAPPED:  # as in _decode
        out_row = tl.load(row_map + b)
        width = tl.where(tl.load(seq_lens + b) > 0, D, 0)
    row = (b * tl.num_programs(1) + h) * SPLITS + tl.arange(0, SPLITS)
    m = tl.load(part_ml + row * 2)
    l = tl.load(part_ml + row * 2 + 1)
    d = tl.arange(0, D_PAD)
    acc = tl.load(part_acc + row[:, None] * D_PAD + d[None, :])
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_max)
    denom = tl.sum(w * l, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    out = tl.sum(w[:, None] * acc, 0) / denom
    tl.store(out_ptr + out_row * stride_qt + h * stride_qh + d, out.to(out_ptr.dtype.element_ty), mask=d < width)


@triton.jit
def _prefill_keys(acc, l_i, m_i, q, k_cache, v_cache, block_tables, s_idx, n0, end, q_pos, window, qk_scale, kvh,
                  stride_bt, stride_cb, stride_ct, stride_ch, d, dmask,
                  BS: tl.constexpr, BLOCK: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr):
    """One BLOCK of keys into a query tile's online softmax (base 2: `qk_scale` carries log2(e)). MASK: the keys
    may be past the tile's first query, past the sequence or outside the window; without it every key is seen by
    every query of the tile, and no comparison runs."""
    pos = n0 + tl.arange(0, BLOCK)
    kvalid = pos < end
    if MASK:
        blk = tl.load(block_tables + s_idx * stride_bt + pos // BS, mask=kvalid, other=0)
        kv_mask = kvalid[:, None] & dmask[None, :]
    else:
        blk = tl.load(block_tables + s_idx * stride_bt + pos // BS)
        kv_mask = dmask[None, :]
    base = blk.to(tl.int64) * stride_cb + (pos % BS) * stride_ct + kvh * stride_ch
    k = tl.load(k_cache + base[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # an FP8 cache: read
    v = tl.load(v_cache + base[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # as q's dtype
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s.to(tl.float32) * qk_scale
    if MASK:
        ok = kvalid[None, :] & (pos[None, :] <= q_pos[:, None])
        if window > 0:
            ok = ok & ((q_pos[:, None] - pos[None, :]) < window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet (a window's edge)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _prefill_tile(tile, h, q_ptr, k_cache, v_cache, out_ptr, block_tables, q_locs, q_lens, ctx_lens, tile_seq,
                  tile_start, scale, window, stride_qt, stride_qh, stride_bt, stride_cb, stride_ct, stride_ch,
                  GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    kvh = h // GROUP
    s_idx = tl.load(tile_seq + tile)
    m0 = tl.load(tile_start + tile)
    q_loc = tl.load(q_locs + s_idx)
    q_len = tl.load(q_lens + s_idx)
    ctx = tl.load(ctx_lens + s_idx)
    seq_len = ctx + q_len
    m = m0 + tl.arange(0, BLOCK_M)
    mmask = m < q_len
    q_pos = ctx + m
    d = tl.arange(0, D_PAD)
    dmask = d < D
    rows = (q_loc + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 below
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)  # causal: no key past the tile's last query
    if window > 0:  # every block may cross some query's window: all masked
        start = tl.maximum(ctx + m0 - window + 1, 0) // BLOCK * BLOCK
        seen_by_all = start
    else:  # keys before the tile's first query: every query sees them
        start = 0
        seen_by_all = (ctx + m0) // BLOCK * BLOCK
    for n0 in range(start, seen_by_all, BLOCK):
        acc, l_i, m_i = _prefill_keys(acc, l_i, m_i, q, k_cache, v_cache, block_tables, s_idx, n0, end, q_pos,
                                      window, qk_scale, kvh, stride_bt, stride_cb, stride_ct, stride_ch, d, dmask,
                                      BS, BLOCK, False, IEEE)
    for n0 in range(seen_by_all, end, BLOCK):  # the diagonal (and the window)
        acc, l_i, m_i = _prefill_keys(acc, l_i, m_i, q, k_cache, v_cache, block_tables, s_idx, n0, end, q_pos,
                                      window, qk_scale, kvh, stride_bt, stride_cb, stride_ct, stride_ch, d, dmask,
                                      BS, BLOCK, True, IEEE)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & dmask[None, :])


@triton.jit
def _prefill(q_ptr, k_cache, v_cache, out_ptr, block_tables, q_locs, q_lens, ctx_lens, tile_seq, tile_start,
             tile_count, scale, window, stride_qt, stride_qh, stride_bt, stride_cb, stride_ct, stride_ch,
             GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr, PERSISTENT: tl.constexpr):
    """One program per (query head, tile); PERSISTENT (a whole-step graph, whose grid cannot follow the step): a fixed
    number of programs per head take the step's `tile_count` tiles in turn."""
    h = tl.program_id(0)  # heads vary fastest: a KV head's query heads run together and share its K/V in L2
    if PERSISTENT:
        for tile in range(tl.program_id(1), tl.load(tile_count), tl.num_programs(1)):
            _prefill_tile(tile, h, q_ptr, k_cache, v_cache, out_ptr, block_tables, q_locs, q_lens, ctx_lens,
                          tile_seq, tile_start, scale, window, stride_qt, stride_qh, stride_bt, stride_cb, stride_ct,
                          stride_ch, GROUP, D, D_PAD, BS, BLOCK_M, BLOCK, IEEE)
    else:  # the host orders tiles by their last query position, longest first
        _prefill_tile(tl.program_id(1), h, q_ptr, k_cache, v_cache, out_ptr, block_tables, q_locs, q_lens, ctx_lens,
                      tile_seq, tile_start, scale, window, stride_qt, stride_qh, stride_bt, stride_cb, stride_ct,
                      stride_ch, GROUP, D, D_PAD, BS, BLOCK_M, BLOCK, IEEE)


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 = skip (padded graph row)
    block_tables: torch.Tensor  # [S, max_blocks] int32
    decode_only: bool  # every sequence has one new token: rows are sequences
    seq_lens: torch.Tensor | None = None  # decode: [S] int32 (0 = padded row)
    q_locs: torch.Tensor | None = None  # prefill: [S] first row of each sequence in the packed batch
    q_lens: torch.Tensor | None = None
    ctx_lens: torch.Tensor | None = None
    tile_seq: torch.Tensor | None = None  # prefill: [tiles] sequence of each BLOCK_M query tile
    tile_start: torch.Tensor | None = None  # its first query index within the sequence
    tile_count: torch.Tensor | None = None  # a whole-step graph: [1], the step's tiles (the arrays are longer)
    tile_programs: int = 0  # a whole-step graph: programs per head that take the tiles in turn (0: one per tile)
    decode_rows: torch.Tensor | None = None  # mixed: [R] int32, the packed batch's rows of the one-token sequences
    decode_part: "TritonAttentionMetadata | None" = None  # mixed: their tables and lengths, for `_decode`


@dataclass(frozen=True)
class StaticShape:
    """The fixed launch shape of a whole-step CUDA graph's attention (common.engine.prefill_graphs) for steps of up to
    `tokens` tokens and `max_seqs` sequences: every array at its largest; the decode kernel over every entry a step
    may have (padded ones of length 0 store nothing), the prefill kernel over `tile_programs` programs a head that
    take the step's tiles in turn (a grid as large as the tiles a step may have would spend most of its waves on
    empty tiles: a 2048-token prompt step has 34 tiles of at most 160)."""

    tokens: int
    max_seqs: int
    block_m: int
    spare_tiles: int = 8  # tile programs a head beyond a step's tokens / block_m: chunks that end mid-tile

    @property
    def tiles(self) -> int:
        """Query tiles a step can have: sum(ceil(q / block_m)) over its chunks of >= 2 tokens is at most
        tokens / block_m + chunks."""
        return -(-self.tokens // self.block_m) + min(self.max_seqs, self.tokens // 2)

    @property
    def tile_programs(self) -> int:
        return min(self.tiles, -(-self.tokens // self.block_m) + self.spare_tiles)

    @property
    def decode_entries(self) -> int:
        return min(self.tokens, self.max_seqs)

    @cached_property
    def sections(self) -> dict[str, slice]:
        """Where each small array lies in the packed int32s (`pack_static` writes them, `static_metadata` views
        them)."""
        sizes = {"q_locs": self.max_seqs, "q_lens": self.max_seqs, "ctx": self.max_seqs, "tile_seq": self.tiles,
                 "tile_start": self.tiles, "tile_count": 1, "decode_rows": self.decode_entries,
                 "decode_lens": self.decode_entries}
        out, at = {}, 0
        for name, size in sizes.items():
            out[name], at = slice(at, at + size), at + size
        return out

    @property
    def packed_size(self) -> int:
        return self.sections["decode_lens"].stop


@dataclass(frozen=True)
class DecodeTuning:
    """Launch shape of the decode kernel (benchmarks/gpu/sweep_decode_attention.py measures the choices)."""

    block_n: int = 64  # keys per loop iteration
    num_warps: int = 4
    num_stages: int = 3
    target_programs: int = 256  # split sequences until batch × KV heads × splits reaches this
    max_splits: int = 32


@dataclass(frozen=True)
class PrefillTuning:
    """Launch shape of the prefill kernel (benchmarks/gpu/sweep_prefill_attention.py measures the choices)."""

    # The sweep's best on a Hopper GPU for every shape it runs: long packed steps, one long prompt, and a chunk
    # after a cached prefix.
    block_m: int = 64  # query tokens of one sequence per program (the host's tiles)
    block_n: int = 64  # keys per loop iteration
    num_warps: int = 4
    num_stages: int = 2


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


class TritonPagedAttention:
    fused_rope_store = True  # the model writes roped K/V with kernels.rope_store_kv and calls `attend`
    graphable = True  # cuda_graphs.DecodeGraphs replays decode steps over `host_arrays`

    def __init__(self, block_size: int, windows: set[int | None], device: torch.device,
                 tuning: DecodeTuning = DecodeTuning(), prefill_tuning: PrefillTuning = PrefillTuning()):
        self.block_size = block_size
        self.windows = windows
        self.device = device
        self.tuning = tuning
        self.prefill_tuning = prefill_tuning

    def host_arrays(self, layout: BatchLayout) -> dict[str, np.ndarray]:
        """The metadata as numpy arrays (the CUDA-graph runner copies these into its static buffers).
        Vectorised over the batch: a per-request loop of small numpy ops cost ~1 ms a step at batch 64."""
        bs = self.block_size
        q_lens = np.asarray(layout.query_lens, dtype=np.int64)
        ctx = np.asarray(layout.context_lens, dtype=np.int64)
        seq_lens = ctx + q_lens
        counts = (seq_lens + bs - 1) // bs  # blocks each sequence uses
        used = chain.from_iterable(t[:n] for t, n in zip(layout.block_tables, counts.tolist()))
        flat = np.fromiter(used, dtype=np.int32, count=int(counts.sum()))
        tables = np.zeros((len(counts), int(counts.max(initial=1))), dtype=np.int32)
        tables[np.repeat(np.arange(len(counts)), counts), np.arange(len(flat)) - np.repeat(np.cumsum(counts) - counts,
                                                                                          counts)] = flat
        num_tokens = int(q_lens.sum())
        q_locs = np.cumsum(q_lens) - q_lens  # each sequence's first row in the packed batch
        rows = np.repeat(np.arange(len(q_lens)), q_lens)
        pos = np.arange(num_tokens) - np.repeat(q_locs, q_lens) + np.repeat(ctx, q_lens)
        slots = tables[rows, pos // bs].astype(np.int64) * bs + pos % bs
        return {"slots": slots, "tables": tables, "seq_lens": seq_lens.astype(np.int32),
                "q_lens": q_lens.astype(np.int32), "ctx": ctx.astype(np.int32), "q_locs": q_locs.astype(np.int32)}

    def _tiles(self, q_lens: np.ndarray, ctx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sequence, first query) of each BLOCK_M query tile of the prompts' chunks, the tiles with the most keys (the
        last query's position) first, so the short ones fill the last wave."""
        block_m, ctx = self.prefill_tuning.block_m, ctx.tolist()
        tiles = sorted(((s, m) for s, q in enumerate(q_lens.tolist()) if q > 1 for m in range(0, q, block_m)),
                       key=lambda t: -(ctx[t[0]] + t[1]))
        return (np.asarray([s for s, _ in tiles], dtype=np.int32).reshape(-1),
                np.asarray([m for _, m in tiles], dtype=np.int32).reshape(-1))

    def prepare(self, layout: BatchLayout) -> TritonAttentionMetadata:
        """The step's metadata on the device, its arrays in one copy (common.engine.host_upload)."""
        a = self.host_arrays(layout)
        q_lens = a["q_lens"]
        if bool((q_lens == 1).all()):
            slots, tables, seq_lens = upload([a["slots"], a["tables"], a["seq_lens"]], self.device)
            return TritonAttentionMetadata(slots, tables, True, seq_lens=seq_lens)
        q_locs = a["q_locs"]
        arrays = [a["slots"], a["tables"], q_locs, q_lens, a["ctx"], *self._tiles(q_lens, a["ctx"])]
        rows = np.flatnonzero(q_lens == 1)
        if len(rows):  # a mixed step: its decode rows go to the decode kernel
            arrays += [q_locs[rows], a["tables"][rows], a["seq_lens"][rows]]
        slots, tables, *rest = upload(arrays, self.device)
        meta = TritonAttentionMetadata(slots, tables, False)
        meta.q_locs, meta.q_lens, meta.ctx_lens, meta.tile_seq, meta.tile_start = rest[:5]
        if len(rows):
            meta.decode_rows = rest[5]
            meta.decode_part = TritonAttentionMetadata(slots, rest[6], True, seq_lens=rest[7])
        return meta

    def pack_static(self, a: dict[str, np.ndarray], shape: StaticShape) -> tuple[np.ndarray, np.ndarray]:
        """A step's `host_arrays` in a whole-step graph's layout: the small arrays packed at fixed offsets, zeros past
        the step's own (`StaticShape`), and the decode entries' block tables. Every one-token sequence is a decode
        entry."""
        q_lens, q_locs = a["q_lens"], a["q_locs"]
        sec = shape.sections
        packed = np.zeros(shape.packed_size, dtype=np.int32)
        tile_seq, tile_start = self._tiles(q_lens, a["ctx"])
        rows = np.flatnonzero(q_lens == 1)
        for name, values in (("q_locs", q_locs), ("q_lens", q_lens), ("ctx", a["ctx"]), ("tile_seq", tile_seq),
                             ("tile_start", tile_start), ("tile_count", [len(tile_seq)]),
                             ("decode_rows", q_locs[rows]), ("decode_lens", a["seq_lens"][rows])):
            packed[sec[name]][: len(values)] = values
        return packed, a["tables"][rows]

    @staticmethod
    def static_metadata(slots: torch.Tensor, packed: torch.Tensor, tables: torch.Tensor, decode_tables: torch.Tensor,
                        shape: StaticShape) -> TritonAttentionMetadata:
        """The metadata of a whole-step graph: views of its static device buffers (`pack_static`'s layout), every
        array at the shape's full size, so the kernels' launch shapes never change."""
        sec = shape.sections
        meta = TritonAttentionMetadata(slots, tables, False)
        meta.q_locs, meta.q_lens, meta.ctx_lens = packed[sec["q_locs"]], packed[sec["q_lens"]], packed[sec["ctx"]]
        meta.tile_seq, meta.tile_start = packed[sec["tile_seq"]], packed[sec["tile_start"]]
        meta.tile_count, meta.tile_programs = packed[sec["tile_count"]], shape.tile_programs
        meta.decode_rows = packed[sec["decode_rows"]]
        meta.decode_part = TritonAttentionMetadata(slots, decode_tables[: shape.decode_entries], True,
                                                   seq_lens=packed[sec["decode_lens"]])
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: TritonAttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
        """Stores the new tokens' K and V, then attends (the model's fused path stores them itself: `attend`)."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [N, bs, Hkv, D], contiguous
        T = q.shape[0]
        k, v = k.reshape(T, -1), v.reshape(T, -1)
        hd = k.shape[1]
        _store_kv[(T,)](k, v, k_cache, v_cache, meta.slot_mapping, k.stride(0), v.stride(0), hd, _pow2(hd))
        return self.attend(q, kv_cache, meta, scale, window)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: TritonAttentionMetadata, scale: float,
               window: int | None) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the cache, where this step's K and V already are."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[2]
        out = torch.empty_like(q)
        group = num_heads // num_kv_heads
        common = dict(D=head_dim, D_PAD=_pow2(head_dim, 16), BS=self.block_size,
                      IEEE=q.dtype == torch.float32)
        strides = (q.stride(0), q.stride(1), meta.block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
                   k_cache.stride(2))
        if meta.decode_only:
            self._decode(q, k_cache, v_cache, out, meta, scale, window, strides, group, common)
            return out
        programs = meta.tile_programs or meta.tile_seq.shape[0]
        if programs:
            t = self.prefill_tuning
            persistent = meta.tile_count is not None
            _prefill[(num_heads, programs)](
                q, k_cache, v_cache, out, meta.block_tables, meta.q_locs, meta.q_lens, meta.ctx_lens, meta.tile_seq,
                meta.tile_start, meta.tile_count if persistent else meta.tile_seq, scale, window or 0, *strides,
                GROUP=group, BLOCK_M=t.block_m, **{**common, "BLOCK": t.block_n}, PERSISTENT=persistent,
                num_warps=t.num_warps, num_stages=t.num_stages)
        if meta.decode_rows is not None:  # read and written at their rows of q and out
            part = meta.decode_part
            self._decode(q, k_cache, v_cache, out, part, scale, window, (*strides[:2], part.block_tables.stride(0),
                                                                         *strides[3:]), group, common, meta.decode_rows)
        return out

    def _decode(self, q, k_cache, v_cache, out, meta, scale, window, strides, group, common, row_map=None) -> None:
        """`meta`'s sequences over the decode kernel: sequence b at row b of q and out, or at row_map[b]."""
        batch = meta.seq_lens.shape[0]
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        t = self.tuning
        splits = decode_splits(batch, num_kv_heads, t.target_programs, t.max_splits)
        d_pad = common["D_PAD"]
        part_acc = q.new_empty((batch * num_heads * splits, d_pad), dtype=torch.float32) if splits > 1 else out
        part_ml = q.new_empty((batch * num_heads * splits, 2), dtype=torch.float32) if splits > 1 else out
        mapped = row_map is not None
        row_map = row_map if mapped else meta.seq_lens  # (not read)
        _decode[(batch, num_kv_heads, splits)](q, k_cache, v_cache, out, part_acc, part_ml, meta.block_tables,
                                               meta.seq_lens, row_map, scale, window or 0, *strides, GROUP=group,
                                               G_PAD=_pow2(group, 16), SPLITS=splits,
                                               **{**common, "BLOCK": t.block_n}, MAPPED=mapped,
                                               num_warps=t.num_warps, num_stages=t.num_stages)
        if splits > 1:
            _merge_splits[(batch, num_heads)](part_acc, part_ml, out, meta.seq_lens, row_map, strides[0], strides[1],
                                              D=common["D"], D_PAD=d_pad, SPLITS=splits, MAPPED=mapped)


def decode_splits(batch: int, num_kv_heads: int, target_programs: int = 256, max_splits: int = 32) -> int:
    """Splits of each sequence so that small batches still fill the GPU (a power of two, at most max_splits).
    A function of shapes only, so a CUDA graph captured for a batch size stays valid."""
    return min(max_splits, _pow2(max(1, target_programs // (batch * num_kv_heads))))

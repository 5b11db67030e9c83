"""CUDA graphs for the steps decode graphs do not take (prompt chunks, mixed steps): the whole forward, attention
included, per token-count bucket.

Eagerly, a step is ~10 launches a layer from Python, and a 3B model's 512-token prefill takes several times its
FLOPs' time: the host, not the GPU, sets the pace. Graphs cut at every attention (attention eager between captured
pieces) halve that, but a mixed step still pays two Triton launches and a replay a layer from Python, a fifth of
its wall time over its kernels' on an idle host, and more on a decode worker whose host also streams tokens.

So attention is captured too, at a launch shape fixed per bucket (`attention_triton.StaticShape`): the prefill
kernel's programs take the step's query tiles in turn (their count is read on the device), the decode kernel runs
over as many one-token sequences as a step can have (padded entries have length 0 and store nothing), each at its
row of the packed batch. A step copies its ids, positions, slots (padded rows: slot -1, nothing stored)
and its packed metadata into the static buffers and replays one graph. Rows past the step's tokens compute garbage
no real row reads (every op but attention is row-wise).
Only one rank (no tensor parallelism: the followers would have to replay in step) and only models whose forward
captures: a model whose capture fails (say, a host sync in an MoE kernel) runs eagerly, with a warning.
"""
from __future__ import annotations

import bisect

import torch

from common.devices import graph_capture
from common.engine.attention import BatchLayout
from common.engine.attention_triton import StaticShape, TritonPagedAttention
from common.engine.host_upload import upload

# Token counts: fine where the host dominates (small steps), 256 apart up to 2048 (at most 255 rows padded), 512
# apart above, up to the GPU's default step of 8192, so that no step runs eagerly: eager steps over 2048 tokens
# stalled some requests by hundreds of ms where graphed ones did not (docs/benchmarks/vllm_gpu.md).
TOKEN_BUCKETS = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 768, 1024, 1280, 1536, 1792, 2048,
                 *range(2560, 8192 + 1, 512))
MAX_TOKENS = TOKEN_BUCKETS[-1]


class PrefillGraphs:
    def __init__(self, model, attention: TritonPagedAttention, kv_cache: torch.Tensor, max_tokens: int,
                 max_seqs: int, max_blocks_per_seq: int, device: torch.device):
        self.model, self.attention, self.kv_cache, self.device = model, attention, kv_cache, device
        cap = min(max_tokens, MAX_TOKENS)  # a longer step runs eagerly
        self.buckets = [b for b in TOKEN_BUCKETS if b < cap] + [cap]
        n = self.buckets[-1]
        block_m = attention.prefill_tuning.block_m
        self.shapes = {b: StaticShape(b, min(max_seqs, b), block_m) for b in self.buckets}
        largest = self.shapes[n]
        self.inputs = torch.zeros((3, n), dtype=torch.long, device=device)  # ids, positions, slots
        # each bucket's packed metadata (its own offsets; all zeros: no tile, no decode entry, so attention does
        # nothing while the graphs are captured); the block tables are shared, at the largest shape
        self.packed = {b: torch.zeros(s.packed_size, dtype=torch.int32, device=device) for b, s in self.shapes.items()}
        self.tables = torch.zeros((largest.max_seqs, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.decode_tables = torch.zeros((largest.decode_entries, max_blocks_per_seq), dtype=torch.int32,
                                         device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.aux: dict[int, torch.Tensor] = {}  # the kept layers' hidden states (model.aux_layers), each graph's own
        self.steps = self.mixed_steps = 0  # steps run through the graphs, and those with decode rows (tests check)
        self._capture()

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def _forward(self, b: int) -> torch.Tensor:
        meta = self.attention.static_metadata(self.inputs[2, :b], self.packed[b], self.tables, self.decode_tables,
                                              self.shapes[b])
        return self.model(self.inputs[0, :b], self.inputs[1, :b], self.kv_cache, meta, self.attention)

    @torch.inference_mode()
    def _capture(self) -> None:
        self.inputs[2].fill_(-1)  # no K/V stored while capturing
        pool = None
        for b in reversed(self.buckets):  # largest first: smaller buckets reuse its memory pool
            self._forward(b)  # compile kernels, settle allocations, uncaptured
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, self.device, pool):
                self.hidden[b] = self._forward(b)
                if getattr(self.model, "aux_layers", ()):
                    self.aux[b] = self.model.aux_hidden
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, layout: BatchLayout) -> bool:
        t, seqs = sum(layout.query_lens), len(layout.query_lens)
        longest = max(c + q for c, q in zip(layout.context_lens, layout.query_lens))
        return (0 < t <= self.max_tokens and seqs <= self.shapes[self.max_tokens].max_seqs
                and longest <= self.tables.shape[1] * self.attention.block_size)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """The final hidden states [T, hidden] of a step of T tokens (the graph's own buffer, valid until the next
        run); `ids` and `positions` are the step's, on the device."""
        t = ids.shape[0]
        b = self.buckets[bisect.bisect_left(self.buckets, t)]
        a = self.attention.host_arrays(layout)
        packed, decode_tables = self.attention.pack_static(a, self.shapes[b])
        slots, packed, tables, decode_tables = upload([a["slots"], packed, a["tables"], decode_tables], self.device)
        self.inputs[2, t:b].fill_(-1)
        self.inputs[0, :t].copy_(ids)
        self.inputs[1, :t].copy_(positions)
        self.inputs[2, :t].copy_(slots)
        self.packed[b].copy_(packed)
        self.tables[: tables.shape[0], : tables.shape[1]].copy_(tables)
        if decode_tables.shape[0]:
            self.decode_tables[: decode_tables.shape[0], : decode_tables.shape[1]].copy_(decode_tables)
        self.steps += 1
        self.mixed_steps += 0 < decode_tables.shape[0] < len(layout.query_lens)
        self.graphs[b].replay()
        if self.aux:  # a copy: whoever keeps them (EAGLE-3) outlives the next replay
            self.model.aux_hidden = self.aux[b][:t].clone()
        return self.hidden[b][:t]

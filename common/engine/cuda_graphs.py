"""CUDA graphs for decode-only steps: one graph per batch-size bucket, captured once, replayed every step.

A decode step of a small model is hundreds of tiny kernels; launching them one by one from Python
costs more than running them. Each graph runs embed → layers → norm → lm head for `bucket` rows over
static input buffers, and the greedy token of each row (argmax of its logits) in the graph too; a step of
B < bucket sequences pads with rows whose slot is -1 (no KV written) and whose sequence length is 0
(attention gives zeros). Only the Triton backend's fixed-shape decode metadata is graph-safe, so graphs
exist only with it.
"""
from __future__ import annotations

import bisect

import torch

from common.devices import graph_capture
from common.engine.attention import BatchLayout
from common.engine.attention_triton import TritonAttentionMetadata, TritonPagedAttention

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, model, attention: TritonPagedAttention, kv_cache: torch.Tensor, max_batch: int,
                 max_blocks_per_seq: int, device: torch.device):
        self.model, self.attention, self.kv_cache, self.device = model, attention, kv_cache, device
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        n, width = self.buckets[-1], max_blocks_per_seq
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros((n, width), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.argmax: dict[int, torch.Tensor] = {}
        self.aux: dict[int, torch.Tensor] = {}  # the kept layers' hidden states (model.aux_layers), each graph's own
        self._capture()

    def _forward(self, bs: int) -> torch.Tensor:
        meta = TritonAttentionMetadata(self.slots[:bs], self.tables[:bs], True, seq_lens=self.seq_lens[:bs])
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_cache, meta, self.attention)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its memory pool
            self._forward(bs)  # compile kernels and settle allocations outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, self.device, pool):
                self.logits[bs] = self._forward(bs)
                self.argmax[bs] = self.logits[bs].argmax(dim=-1)
                if getattr(self.model, "aux_layers", ()):
                    self.aux[bs] = self.model.aux_hidden
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, layout: BatchLayout) -> bool:
        return (len(layout.query_lens) <= self.buckets[-1] and all(q == 1 for q in layout.query_lens)
                and max(layout.seq_lens) <= self.tables.shape[1] * self.attention.block_size)

    def run(self, input_ids: list[int] | torch.Tensor, positions: list[int],
            layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, vocab], greedy tokens [B]) of a decode-only step of B sequences; both are the graph's
        own buffers, valid until its next replay. `input_ids` may be a device tensor (the tokens of a step
        still running, for a step launched ahead). The metadata goes up from fresh pinned buffers of torch's
        caching host allocator, which keeps each one until its non-blocking copy has run: a step may be
        staged while the one before it is still queued."""
        b = len(positions)
        bs = self.buckets[bisect.bisect_left(self.buckets, b)]
        a = self.attention.host_arrays(layout)
        width = a["tables"].shape[1]
        longs = torch.empty((3, bs), dtype=torch.long, pin_memory=True)
        host = longs.numpy()
        host[0, :b] = input_ids if isinstance(input_ids, list) else 0
        host[1, :b], host[2, :b] = positions, a["slots"]
        host[0, b:], host[1, b:], host[2, b:] = 0, 0, -1
        ints = torch.empty(bs * width + bs, dtype=torch.int32, pin_memory=True)  # tables, then sequence lengths
        tables = ints[: bs * width].numpy().reshape(bs, width)  # padded rows: table entries never read
        tables[:b] = a["tables"]
        lens = ints[bs * width:].numpy()
        lens[:b], lens[b:] = a["seq_lens"], 0
        staged_longs = longs.to(self.device, non_blocking=True)
        staged_ints = ints.to(self.device, non_blocking=True)
        self.input_ids[:bs].copy_(staged_longs[0])
        if isinstance(input_ids, torch.Tensor):
            self.input_ids[:b].copy_(input_ids)
        self.positions[:bs].copy_(staged_longs[1])
        self.slots[:bs].copy_(staged_longs[2])
        self.tables[:bs, :width].copy_(staged_ints[: bs * width].view(bs, width))
        self.seq_lens[:bs].copy_(staged_ints[bs * width:])
        self.graphs[bs].replay()
        if self.aux:  # a copy: whoever keeps them (EAGLE-3) outlives the next replay
            self.model.aux_hidden = self.aux[bs][:b].clone()
        return self.logits[bs][:b], self.argmax[bs][:b]

"""CUDA graphs for the steps decode graphs do not take (prompt chunks, mixed steps): everything but attention,
in pieces, per token-count bucket.

Eagerly, a step is ~10 launches a layer from Python. On the 4 x H200 machine's host that made a 512-token prefill
of the Llama-3.2-3B shape 12-23 ms (3.8 ms of FLOPs at the measured matmul rate), and a mixed step (32 decode rows
and a 480-token chunk) 20-22 ms for 6.9 ms of kernels: the GPU waited on the host. With these graphs: 7.0 ms and
10.4 ms (`python -m tests.bench.gpu_prefill --mixed-batch 32`; README, "Prompt and mixed steps").
Attention's launch shape depends on the step (each chunk's tiles, the decode rows), so it stays eager; what lies
between two attentions depends only on the token count. For each bucket the model's own forward is captured once,
cut at every attention call:
- piece 0: embed → layer 0's norm → QKV → RoPE and the K/V store (into the cache at the static slots);
- piece i: layer i-1's output projection → its MLP → layer i's norm → QKV → RoPE and store;
- the last: the last layer's output projection and MLP, the final norm.
A step copies its ids, positions and slots into the static inputs (padded rows: slot -1, nothing stored), replays
piece 0, then per layer runs attention eagerly over that piece's q into its static output and replays the next
piece. Rows past the step's tokens compute garbage no real row reads (every op but attention is row-wise).
Only one rank (no tensor parallelism: the followers would have to replay in step) and only models whose every
piece captures: a model whose capture fails (say, a host sync in an MoE kernel) runs eagerly, with a warning.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from common.devices import CAPTURE_ERROR_MODE, capture_stream, collector_paused
from common.engine.attention_triton import TritonAttentionMetadata, TritonPagedAttention

# Token counts: fine where the host dominates (small steps), 256 apart above 512 (at most 255 rows padded).
TOKEN_BUCKETS = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 768, 1024, 1280, 1536, 1792, 2048)
MAX_TOKENS = TOKEN_BUCKETS[-1]


@dataclass
class _AttentionCall:
    """One layer's attention between two pieces: its static q (the piece before writes it) and output (the piece
    after reads it)."""
    q: torch.Tensor
    kv_cache: torch.Tensor
    out: torch.Tensor
    scale: float
    window: int | None


class _Cuts:
    """The attention backend the model sees while a bucket is captured: each `attend` ends the piece being captured
    and starts the next; while warming up (no capture) it only hands back an output of q's shape."""
    fused_rope_store = True

    def __init__(self, pool: tuple[int, int] | None):
        self.pool = pool  # every piece of every bucket in one memory pool
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_AttentionCall] = []
        self._open: torch.cuda.CUDAGraph | None = None  # the piece being captured; None while warming up

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode=CAPTURE_ERROR_MODE)
        self._open = graph

    def end(self) -> None:
        """End the piece being captured, if one is (also after a failed capture: the stream stops capturing)."""
        graph, self._open = self._open, None
        if graph is not None:
            graph.capture_end()
            self.pieces.append(graph)

    def attend(self, q, kv_cache, meta, scale, window):
        out = torch.empty_like(q)
        if self._open is not None:
            self.end()
            self.calls.append(_AttentionCall(q, kv_cache, out, scale, window))
            self.begin()
        return out


class PrefillGraphs:
    def __init__(self, model, attention: TritonPagedAttention, kv_cache: torch.Tensor, max_tokens: int,
                 device: torch.device):
        self.model, self.attention, self.kv_cache, self.device = model, attention, kv_cache, device
        cap = min(max_tokens, MAX_TOKENS)  # a longer step (a budget over 2048) runs eagerly: the GPU is the bound
        self.buckets = [b for b in TOKEN_BUCKETS if b < cap] + [cap]
        n = self.buckets[-1]
        self.inputs = torch.zeros((3, n), dtype=torch.long, device=device)  # ids, positions, slots
        self._no_tables = torch.zeros((0, 0), dtype=torch.int32, device=device)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.calls: dict[int, list[_AttentionCall]] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.steps = self.mixed_steps = 0  # steps run through the graphs, and those with decode rows (tests check)
        self._capture()

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def _forward(self, b: int, cuts: _Cuts) -> torch.Tensor:
        meta = TritonAttentionMetadata(self.inputs[2, :b], self._no_tables, False)  # pieces read only the slots
        return self.model(self.inputs[0, :b], self.inputs[1, :b], self.kv_cache, meta, cuts)

    @torch.inference_mode()
    def _capture(self) -> None:
        self.inputs[2].fill_(-1)  # no K/V stored while capturing
        pool = torch.cuda.graph_pool_handle()
        with collector_paused():
            for b in reversed(self.buckets):  # largest first: smaller buckets reuse its memory pool
                self._forward(b, _Cuts(None))  # compile kernels, settle allocations, uncaptured
                torch.cuda.synchronize(self.device)
                cuts = _Cuts(pool)
                with torch.cuda.stream(capture_stream(self.device)):
                    cuts.begin()
                    try:
                        self.hidden[b] = self._forward(b, cuts)
                    finally:
                        cuts.end()
                torch.cuda.synchronize(self.device)
                self.pieces[b], self.calls[b] = cuts.pieces, cuts.calls

    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: TritonAttentionMetadata) -> torch.Tensor:
        """The final hidden states [T, hidden] of a step of T tokens (the graphs' own buffer, valid until the next
        run); `ids`, `positions` and `meta` (attention's, from `prepare`) are the step's, on the device."""
        t = ids.shape[0]
        b = self.buckets[bisect.bisect_left(self.buckets, t)]
        self.inputs[2, t:b].fill_(-1)
        self.inputs[0, :t].copy_(ids)
        self.inputs[1, :t].copy_(positions)
        self.inputs[2, :t].copy_(meta.slot_mapping)
        pieces, calls = self.pieces[b], self.calls[b]
        self.steps += 1
        self.mixed_steps += meta.decode_rows is not None
        pieces[0].replay()
        for call, piece in zip(calls, pieces[1:]):
            self.attention.attend(call.q[:t], call.kv_cache, meta, call.scale, call.window, out=call.out[:t])
            piece.replay()
        return self.hidden[b][:t]

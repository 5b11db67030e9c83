"""EAGLE-3 drafts: one decoder layer over the target's own hidden states drafts each row's next k tokens.

The target keeps, at every position a step computes, its residual stream at three layers (LlamaForCausalLM's
`aux_layers`; the model runner hands them here after each forward, `keep`). Position p's hidden state with the
token after it, p + 1, is one input of the head, which predicts the token after that. Before a step a row whose
prompt + output is L tokens long has the target's hidden states up to position L - 2 (the target computes a
decode row's last token in the step itself): the head first runs every position it has not seen since its last
proposal (the tokens the target accepted since, one more than it accepted; at the first, the whole prompt) in
one batched pass, whose last position gives draft 1; then each further draft is one token a row, its input the
draft before and the head's own pre-norm output there, as the head was trained (its "training-time test").

The head's KV is its own: one layer, paged in blocks of the target's size by a BlockManager of its own (the
target's block count, and K more tokens for each of --max-num-seqs rows). A row's blocks hold positions from
`base` on; the KV its drafts wrote is overwritten by the next proposal, which recomputes those positions from the
target's hidden states. Where the target computed no hidden state for some positions (a prefix-cache hit, a
prompt whose KV came from a prefill worker, a choice forked from its leader), the row starts over after them:
the head attends to the positions it saw, so drafts suffer there, never the tokens (the target verifies them).
A row's blocks and hidden states are freed when its request ends or is aborted (`forget`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from common.engine.attention import BatchLayout
from common.engine.block_manager import BlockManager
from common.engine.model_runner import make_attention_backend
from common.engine.request import Request, RequestType
from common.engine.spec.config import FLAG, SpeculativeConfig
from common.engine.spec.eagle3_head import Eagle3Head, load_head
from common.engine.spec.memory import draft_rows_blocks
from common.errors import InvalidConfig

log = logging.getLogger(__name__)


@dataclass
class _HeadRow:
    """One request's head KV: positions [base, done) hold what the target's hidden states gave (the block manager
    reads block_table, block_hashes and num_computed_tokens as a request's)."""

    base: int = 0
    done: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


@dataclass
class _Pass:
    """A row of one proposal: its head KV, prompt + output (`length` tokens), k, and the target's hidden states of
    positions [first, length - 1), the ones the head runs first."""

    index: int
    row: _HeadRow
    history: object
    k: int
    first: int
    hidden: torch.Tensor

    @property
    def length(self) -> int:
        return len(self.history)


class _Hidden:
    """One request's target hidden states not yet run by the head: contiguous segments (first position, rows)."""

    def __init__(self):
        self.segments: list[tuple[int, torch.Tensor]] = []

    def write(self, start: int, rows: torch.Tensor) -> None:
        """A step's rows from `start` on; what was kept from there on (rejected drafts' positions) is replaced, and
        a gap before `start` drops everything before it."""
        kept = [(s, t[: start - s]) for s, t in self.segments if s < start]
        if kept and kept[-1][0] + len(kept[-1][1]) != start:
            kept = []
        self.segments = [(s, t) for s, t in kept if len(t)] + [(start, rows)]

    def span(self, first: int, end: int) -> tuple[int, torch.Tensor] | None:
        """(p, rows of positions [p, end)) for the smallest p >= first held; None where end is not reached."""
        if not self.segments or self.segments[0][0] + sum(len(t) for _, t in self.segments) < end:
            return None
        start = max(first, self.segments[0][0])
        if start >= end:
            return None
        rows = torch.cat([t for _, t in self.segments]) if len(self.segments) > 1 else self.segments[0][1]
        offset = start - self.segments[0][0]
        return start, rows[offset: offset + end - start]

    def drop_before(self, position: int) -> None:
        self.segments = [(max(s, position), t[max(position - s, 0):]) for s, t in self.segments
                         if s + len(t) > position]


class Eagle3Proposer:
    def __init__(self, head: Eagle3Head, layers: tuple[int, ...], target, num_blocks: int):
        """`target`: the LLMEngine whose hidden states of `layers` the head reads."""
        self.head = head
        self.embed = head.embed_tokens if head.embed_tokens is not None else target.runner.model.embed
        self.target_vocab_size = target.vocab_size
        self.max_len = min(target.max_model_len, head.config.max_position_embeddings)
        self.block_size = target.config.block_size
        self.blocks = BlockManager(num_blocks, self.block_size, enable_prefix_caching=False)
        runner = target.runner
        attn = head.midlayer.self_attn
        self.kv = torch.zeros((2, num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim),
                              dtype=runner.dtype, device=runner.device)
        self.attention = make_attention_backend(self.block_size, {None}, runner.device)
        self.device = runner.device
        self._rows: dict[str, _HeadRow] = {}
        self._hidden: dict[str, _Hidden] = {}
        runner.model.aux_layers = layers
        runner.hidden_sink = self.keep

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target) -> "Eagle3Proposer":
        t = target.config
        if t.tensor_parallel_size != 1 or config.draft_tensor_parallel_size not in (None, 1):
            raise InvalidConfig(f"{FLAG}: an eagle3 head runs beside a target on one device "
                                "(--tensor-parallel-size 1)")
        head, layers = load_head(config.model, target, target.runner.dtype, target.runner.device,
                                 t.dummy_seed if t.load_format == "dummy" else None)
        rows_k = draft_rows_blocks(config, t.max_num_seqs, t.block_size)
        proposer = cls(head, layers, target, target.block_manager.num_blocks + rows_k)
        log.info("speculative decoding: EAGLE-3 head %s over the target's layers %s, %d KV blocks", config.model,
                 list(layers), proposer.blocks.num_blocks)
        return proposer

    # --- the target's side: its hidden states after each forward ---

    def keep(self, spans: list[tuple[Request, int, int]], hidden: torch.Tensor) -> None:
        """The model runner's hand-off after a forward: each (request, first position, tokens) of the step, in
        order, and the hidden states [tokens, 3 * hidden] of the packed step. Requests that never draft (a
        prefill worker's prompts, grammar or penalty rows) keep none."""
        offset = 0
        for request, start, n in spans:
            if request.request_type is not RequestType.CONTEXT_ONLY and request.grammar is None \
                    and not request.sampling.adjusts_logits:
                self._hidden.setdefault(request.request_id, _Hidden()).write(start, hidden[offset: offset + n])
            offset += n

    # --- proposing ---

    @torch.inference_mode()
    def propose_many(self, histories: list, ks: list[int], request_ids: list[str]) -> list[list[int]]:
        """Each row's greedy draft of up to ks[i] tokens after histories[i] (prompt + output); [] for a row whose
        target hidden states the head lacks, past the head's context, or short of head KV blocks."""
        drafts: list[list[int]] = [[] for _ in histories]
        rows: list[_Pass] = []
        for i, (history, k, request_id) in enumerate(zip(histories, ks, request_ids, strict=True)):
            length = len(history)
            hidden = self._hidden.get(request_id)
            if k < 1 or length + k > self.max_len or hidden is None:
                continue
            row = self._rows.setdefault(request_id, _HeadRow())
            got = hidden.span(min(row.done, length - 2), length - 1)
            if got is None:
                continue
            first, target_rows = got
            if first > row.done:  # positions the target computed elsewhere: start over after them
                self.blocks.free(row)
                row.base = row.done = first
            row.num_computed_tokens = 0
            if self.blocks.allocate_slots(row, length + k - 2 - row.base):
                rows.append(_Pass(i, row, history, k, first, target_rows))
        if rows:
            for one, tokens in zip(rows, self._draft(rows)):
                drafts[one.index] = tokens
        for one, request_id in ((one, request_ids[one.index]) for one in rows):
            one.row.done = one.length - 1
            self._hidden[request_id].drop_before(one.length - 2)
        return drafts

    def _draft(self, rows: list[_Pass]) -> list[list[int]]:
        """The head's passes over `rows`: the catch-up one, then one a further draft."""
        head = self.head
        layout = BatchLayout(query_lens=[r.length - 1 - r.first for r in rows],
                             context_lens=[r.first - r.row.base for r in rows],
                             block_tables=[r.row.block_table for r in rows])
        tokens = np.concatenate([np.asarray(r.history[r.first + 1:]) for r in rows])
        positions = np.concatenate([np.arange(r.first, r.length - 1) for r in rows])
        normed, prenorm = self._forward(self._upload(tokens), head.fc(torch.cat([r.hidden for r in rows])),
                                        positions, layout)
        last = torch.tensor(np.cumsum(layout.query_lens) - 1, device=self.device)
        ids, hidden = head.draft_ids(normed[last]), prenorm[last]
        out, live = [ids], list(range(len(rows)))
        for step in range(1, max(r.k for r in rows)):
            going = [j for j in live if rows[j].k > step]
            if len(going) < len(live):
                index = torch.tensor([live.index(j) for j in going], device=self.device)
                ids, hidden, live = ids[index], hidden[index], going
            at = [rows[j].length - 2 + step for j in live]  # each row's position of this draft's input
            layout = BatchLayout(query_lens=[1] * len(live),
                                 context_lens=[p - rows[j].row.base for j, p in zip(live, at)],
                                 block_tables=[rows[j].row.block_table for j in live])
            normed, hidden = self._forward(ids, hidden, np.array(at), layout)
            ids = head.draft_ids(normed)
            out.append(torch.full((len(rows),), -1, dtype=torch.long, device=self.device).index_copy_(
                0, torch.tensor(live, device=self.device), ids))
        table = torch.stack(out, dim=1).tolist()  # one copy to the host for every draft
        return [self._in_vocab(t[: r.k]) for t, r in zip(table, rows)]

    def _forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: np.ndarray, layout: BatchLayout):
        embeds = self.embed(ids)
        return self.head(embeds, hidden.to(embeds.dtype), self._upload(positions), self.kv,
                         self.attention.prepare(layout), self.attention)

    def _upload(self, values: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.int64)).to(self.device)

    def _in_vocab(self, draft: list[int]) -> list[int]:
        """The draft up to a token outside the target's vocabulary (a padded head vocabulary), or a missing one."""
        for i, token in enumerate(draft):
            if not 0 <= token < self.target_vocab_size:
                return draft[:i]
        return draft

    def forget(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self.blocks.free(row)
        self._hidden.pop(request_id, None)

    def close(self) -> None:
        for request_id in list(self._rows):
            self.forget(request_id)
        self._hidden.clear()

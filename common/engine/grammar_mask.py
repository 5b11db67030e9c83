"""The token masks a batch's grammar rows put on its logits, whichever backend each row's grammar is of
(common.engine.grammar_backend): each backend fills its rows into one bitmask, and one kernel masks them all. Only
rows with a grammar are masked; the others share the batch untouched.
"""
from __future__ import annotations

import torch
import xgrammar as xgr

from common.engine import kernels
from common.engine.grammar_backend import BatchFill, GrammarState
from common.engine.greedy import greedy_tokens


class GrammarMasks:
    """The token bitmasks of a batch's grammar rows, in buffers kept for the engine's life: one on the host (pinned
    on a GPU, where one non-blocking copy takes it up) and one on the logits' device, each with the grammar rows'
    indices beside it. They grow only when a batch is wider than any before; xgrammar's kernel masks only the
    grammar rows, so the others stay as they are."""

    def __init__(self) -> None:
        self._fills: dict[type[BatchFill], BatchFill] = {}  # each backend's, made at its first row
        self._host: torch.Tensor | None = None  # [rows, words] int32, the bitmask every backend fills
        self._host_rows: torch.Tensor | None = None  # [rows] int32: which batch rows the bitmask fills
        self._device: torch.Tensor | None = None
        self._device_rows: torch.Tensor | None = None
        self._uploaded: torch.cuda.Event | None = None  # the last upload: once it ran, the host buffers are free

    def greedy(self, logits: torch.Tensor, grammars: list[GrammarState | None]) -> torch.Tensor:
        """Each row's greedy token [B], on the logits' device, the grammar rows' under their masks (a step launched
        ahead; on the CPU only the rows whose argmax their grammar refuses are filled: see unfilled)."""
        if logits.device.type == "cpu":
            grammars = self.unfilled(logits, grammars, [g is not None for g in grammars])
        self.apply(logits, grammars)
        return greedy_tokens(logits)

    def unfilled(self, logits: torch.Tensor, grammars: list[GrammarState | None],
                 greedy: list[bool]) -> list[GrammarState | None]:
        """The grammars whose masks `apply` must still fill: all but those of greedy rows whose argmax their grammar
        allows. Such a token is the masked argmax too (the mask only lowers other logits to -inf; ties keep the first
        index either way), so a row where the model keeps to its grammar by itself needs no fill: on the CPU, where
        nothing overlaps a fill, that saves its time. (Not on a GPU, where the fill overlaps the forward and the check
        would wait for the logits, and costs more than the slow fills it skips where the grammar refuses most argmaxes.)
        """
        argmax = greedy_tokens(logits).tolist()
        return [None if g is not None and checked and g.allows(token) else g
                for g, checked, token in zip(grammars, greedy, argmax)]

    def apply(self, logits: torch.Tensor, grammars: list[GrammarState | None]) -> None:
        """Set to -inf, in place, each grammar row's logits of tokens its grammar does not allow next. logits [B, V].

        The masks are filled on the host before anything waits for the logits: on a GPU that work overlaps the
        forward still running there, and two copies (from pinned memory) and one kernel mask every row."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return
        batch, vocab = logits.shape
        self._reserve(batch, xgr.get_bitmask_shape(1, vocab)[1], logits.device)
        if self._uploaded is not None:  # (done already, in the engine's order of steps)
            self._uploaded.synchronize()
        host, host_rows = self._host[:batch], self._host_rows[: len(rows)]
        self.fill(grammars, host)
        if logits.device.type != "cuda":
            xgr.apply_token_bitmask_inplace(logits, host, vocab_size=vocab, indices=rows)
            return
        host_rows.numpy()[:] = rows
        bitmask, indices = self._device[:batch], self._device_rows[: len(rows)]
        bitmask.copy_(host, non_blocking=True)
        indices.copy_(host_rows, non_blocking=True)
        self._uploaded = torch.cuda.Event()
        self._uploaded.record()
        # xgrammar's kernel masks every backend's rows (one layout); it is triton's, or where triton is not installed
        # (a CPU image's xgrammar) its torch one.
        backend = "triton" if kernels.HAS_TRITON else "torch_native"
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=indices, backend=backend)

    def fill(self, grammars: list[GrammarState | None], bitmask: torch.Tensor) -> None:
        """Write each grammar row's next-token mask into its row of `bitmask` (host, int32 [len(grammars), words]),
        each backend its own rows."""
        by_fill: dict[type[BatchFill], list[int]] = {}
        for i, grammar in enumerate(grammars):
            if grammar is not None:
                by_fill.setdefault(grammar.fill_class, []).append(i)
        for fill_class, rows in by_fill.items():
            if fill_class not in self._fills:
                self._fills[fill_class] = fill_class()
            self._fills[fill_class].fill([grammars[i] for i in rows], bitmask, rows)

    def _reserve(self, batch: int, words: int, device: torch.device) -> None:
        if (self._host is not None and self._host.shape[0] >= batch and self._host.shape[1] == words
                and self._device.device == device):
            return
        if self._uploaded is not None:  # the old buffers may still be read by their last copy
            self._uploaded.synchronize()
            self._uploaded = None
        rows = max(batch, 2 * self._host.shape[0] if self._host is not None else 8)
        pinned = device.type == "cuda"
        self._host = torch.full((rows, words), -1, dtype=xgr.bitmask_dtype, pin_memory=pinned)
        self._host_rows = torch.zeros(rows, dtype=torch.int32, pin_memory=pinned)
        self._device = self._host.to(device)
        self._device_rows = self._host_rows.to(device)

"""The one text stream of a request: incremental detokenisation and stop strings.

Owned by whoever talks to the user (the router, `disagg run`); workers stop on token ids and
lengths only (common.engine.stopping). Torch-free.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context, as vLLM does, so the first output token gets the
# same leading-space treatment as it would inside the whole text.
CONTEXT_TOKENS = 5


@dataclass
class TextDelta:
    text: str
    matched_stop: str | None = None


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one add() per step.

    Decodes only a window: ids[prefix_offset:read_offset] is the text already emitted (left
    context), ids[read_offset:] is new. Text ending in U+FFFD is an incomplete UTF-8 character
    and waits for more tokens (the vLLM / TGI technique). Text that may be the start of a stop
    string waits until it is resolved.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1  # a whole stop is matched, not held
        self._by_first_char: dict[str, list[str]] = {}
        for s in self._stop:
            self._by_first_char.setdefault(s[0], []).append(s)
        context = list(prompt_token_ids[max(0, len(prompt_token_ids) - CONTEXT_TOKENS) :])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # the prompt ends mid-character: context would shift the output's bytes
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._held = ""
        self._pieces: list[str] = []  # the emitted text; joined on demand, as += would copy it all every delta
        self._matched_stop: str | None = None

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    @property
    def matched_stop(self) -> str | None:
        return self._matched_stop

    def add(self, token_ids: Sequence[int]) -> TextDelta:
        if self._matched_stop is not None:
            return TextDelta("", self._matched_stop)
        self._ids.extend(token_ids)
        return self._emit(self._detokenize(final=False), final=False)

    def flush(self) -> str:
        """The held-back text, at the end of generation."""
        if self._matched_stop is not None:
            return ""
        return self._emit(self._detokenize(final=True), final=True).text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _detokenize(self, final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def _emit(self, new_text: str, final: bool) -> TextDelta:
        buffer = self._held + new_text
        match = self._find_stop(buffer)
        if match is not None:
            index, self._matched_stop = match
            out, self._held = buffer[:index], ""
        else:
            keep = 0 if final else self._stop_prefix_len(buffer)
            out, self._held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
        self._pieces.append(out)
        return TextDelta(out, self._matched_stop)

    def _find_stop(self, buffer: str) -> tuple[int, str] | None:
        """The earliest stop string in buffer (the first listed, at a tie). The buffer is already the window a match
        can be in: the new text and the held text before it, which is shorter than the longest stop and holds none
        whole. So a delta costs O(len(new text) + the longest stop) per stop, however long the text."""
        found = [(i, order, s) for order, s in enumerate(self._stop) if (i := buffer.find(s)) >= 0]
        if not found:
            return None
        index, _, stop = min(found)
        return index, stop

    def _stop_prefix_len(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that some stop string starts with (it holds no stop whole).

        Tried from the earliest position a stop could start at, so the first that fits is the longest. A position
        that fits no stop is emitted now and never tried again: over the whole text each position fails once, so
        a delta costs O(len(new text) + 1) positions, each checked against the stops that start with its char."""
        for p in range(max(0, len(buffer) - self._max_hold), len(buffer)):
            stops = self._by_first_char.get(buffer[p])
            if stops is not None:
                tail = buffer[p:]
                if any(stop.startswith(tail) for stop in stops):
                    return len(buffer) - p
        return 0

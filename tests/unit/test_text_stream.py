"""Stop strings in the text stream: the windowed search (each delta looks only where a stop could end in the new
text, and tries a held position once) gives exactly what searching the whole buffer for every stop gives."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.text_stream import IncrementalDetokenizer

PIECES = ["a", "b", "ab", "ba", " ", "aab", "", "c", "abc"]  # token id = index; overlapping text on purpose


class PieceTokenizer:
    """Each id decodes to its piece, the text of ids to their pieces joined: text in, text out."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


class NaiveStops:
    """The reference: every delta searches all of held + new for every stop, and holds the longest suffix that
    some stop starts with."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.matched: str | None = None

    def emit(self, new: str, final: bool) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", self.matched
        buffer = self.held + new
        found = [(buffer.find(s), order, s) for order, s in enumerate(self.stops) if s in buffer]
        if found:
            index, _, self.matched = min(found)
            self.held = ""
            return buffer[:index], self.matched
        keep = 0 if final else max((k for k in range(1, len(buffer) + 1)
                                    if any(len(s) > k and s.startswith(buffer[-k:]) for s in self.stops)), default=0)
        out, self.held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep:]
        return out, None


stops_st = st.lists(st.text(alphabet="ab c", min_size=0, max_size=7), max_size=6)
chunks_st = st.lists(st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=4), max_size=30)


@settings(max_examples=400, deadline=None)
@given(stops=stops_st, chunks=chunks_st)
def test_windowed_stop_matching_equals_searching_everything(stops, chunks):
    stream = IncrementalDetokenizer(PieceTokenizer(PIECES), [], stop=stops)
    naive = NaiveStops(stops)
    for chunk in chunks:
        delta = stream.add(chunk)
        assert (delta.text, delta.matched_stop) == naive.emit("".join(PIECES[i] for i in chunk), final=False)
    if naive.matched is None:
        assert stream.flush() == naive.emit("", final=True)[0]
    assert stream.matched_stop == naive.matched


class CountedStop(str):
    """A stop string that counts the prefix checks made against it."""

    checks = 0

    def startswith(self, prefix, *args) -> bool:
        CountedStop.checks += 1
        return super().startswith(prefix, *args)


@pytest.mark.parametrize("piece", ["aaaa", "aaba", "a ab"])
def test_a_delta_checks_each_new_position_once_per_stop_however_long_the_text(piece):
    """The largest stops the limits allow (64 of 64 characters, all starting with what the text is made of, one
    held 63 characters back): each delta makes at most 64 prefix checks per new character (+1), late in a text of
    40000 characters as at its start."""
    stops = [CountedStop("ab" * 32)] * 63 + [CountedStop("a" * 63 + "b")]
    stream = IncrementalDetokenizer(PieceTokenizer([piece]), [], stop=stops)
    per_delta = []
    for _ in range(10_000):
        CountedStop.checks = 0
        assert stream.add([0]).matched_stop is None
        per_delta.append(CountedStop.checks)
    assert max(per_delta) <= len(stops) * (len(piece) + 1)
    assert max(per_delta[-100:]) <= max(per_delta[:100])

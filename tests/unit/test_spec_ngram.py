"""Prompt lookup drafts: the longest recurring suffix n-gram, its earliest occurrence, as vLLM's NgramProposer."""
from __future__ import annotations

import time

import numpy as np
import pytest

from common.engine.spec.history import TokenHistory
from common.engine.spec.ngram import NgramProposer


def _kmp_reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's search, restated: a longest-prefix-suffix scan of the reversed context, capped at max_n, keeping
    the longest match and (on ties) the one furthest into the reversal, i.e. the earliest in the context."""
    total = len(tokens)
    if total < min_n or k < 1:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n
    longest = position = prev = 0
    i = 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return tokens[start: start + k]


def test_docstring_example_of_vllm():
    # [4, 2, 3] never recurs; [2, 3] does, followed by [4, 2, 3] (fewer than k: the context ends).
    assert NgramProposer(2, 3).propose([1, 2, 3, 4, 2, 3], k=4) == [4, 2, 3]


def test_longest_ngram_wins_over_a_later_shorter_one():
    tokens = [7, 8, 9, 1, 5, 0, 9, 2, 7, 8, 9]
    # [7, 8, 9] recurs at the start (→ 1, 5); [9] alone also follows 0 (→ 2), but the 3-gram is longer.
    assert NgramProposer(1, 3).propose(tokens, k=2) == [1, 5]


def test_earliest_occurrence_of_the_longest_is_taken():
    tokens = [3, 4, 10, 11, 3, 4, 20, 21, 3, 4]
    assert NgramProposer(2, 2).propose(tokens, k=2) == [10, 11]


def test_no_draft_below_min_n_or_without_room():
    proposer = NgramProposer(3, 4)
    assert proposer.propose([1, 2, 9, 1, 2], k=3) == []  # only a 2-gram recurs
    assert proposer.propose([1, 2, 3], k=3) == []
    assert proposer.propose([1, 2, 3, 1, 2, 3], k=0) == []


def test_takes_a_numpy_array_and_returns_ints():
    draft = NgramProposer(1, 2).propose(np.array([5, 6, 7, 5, 6], dtype=np.int32), k=3)
    assert draft == [7, 5, 6] and all(type(t) is int for t in draft)


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_matches_vllms_search_on_random_contexts(vocab):
    rng = np.random.default_rng(vocab)
    for trial in range(400):
        tokens = rng.integers(0, vocab, size=int(rng.integers(1, 60))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        assert NgramProposer(min_n, max_n).propose(tokens, k) == _kmp_reference(tokens, min_n, max_n, k), \
            (tokens, min_n, max_n, k)


def test_cost_per_call_on_a_4k_context():
    # Printed, not asserted: a real-looking context (a 32k vocabulary with a repeated span) and a worst case
    # (a 4-token vocabulary: every position a candidate).
    rng = np.random.default_rng(0)
    text = rng.integers(0, 32000, size=4096)
    text[3000:3200] = text[1000:1200]
    text[-8:] = text[1100:1108]
    cases = {"32k vocab": text, "4-token vocab": rng.integers(0, 4, size=4096)}
    proposer = NgramProposer(2, 5)
    for name, tokens in cases.items():
        history = TokenHistory(tokens[:100].tolist())
        history.update(tokens[100:].tolist())
        for kind, context in (("TokenHistory", history.update(tokens[100:].tolist())), ("list", tokens.tolist())):
            proposer.propose(context, 4)
            calls = 2000
            start = time.perf_counter()
            for _ in range(calls):
                proposer.propose(context, 4)
            print(f"ngram propose, 4096 tokens, {name}, {kind}: {(time.perf_counter() - start) / calls * 1e6:.1f} us")
    assert proposer.propose(text, 4) == text[1108:1112].tolist()


def test_token_history_copies_only_new_tokens_and_grows():
    history = TokenHistory([1, 2, 3])
    output: list[int] = []
    for token in range(100):
        output.append(token)
        view = history.update(output)
    assert view.tolist() == [1, 2, 3, *range(100)] and len(history) == 103
    assert history.update(output).tolist() == view.tolist()  # nothing new: the same context
    with pytest.raises(ValueError, match="output shrank"):
        history.update(output[:5])


def test_proposer_on_a_history_drafts_as_on_the_list():
    prompt = [9, 1, 2, 3, 4, 9, 1]
    history = TokenHistory(prompt)
    proposer = NgramProposer(1, 3)
    assert proposer.propose(history.update([2]), 3) == proposer.propose(prompt + [2], 3) == [3, 4, 9]

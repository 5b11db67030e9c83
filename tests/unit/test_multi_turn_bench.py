"""benchmarks/multi_turn.py's pure pieces: its conversations (deterministic, no two sharing a prefix, each turn's
request carrying the whole history), the think times, the percentiles and summaries, the working set, and the
side-by-side report's ratios and answer check."""
from __future__ import annotations

import statistics

import pytest

from benchmarks.multi_turn import Result, Turn, conversations, report, summarize, think_times, working_set_blocks


def test_conversations_are_deterministic_and_distinct_from_their_first_words():
    chats = conversations(4, 3)
    assert chats == conversations(4, 3) and chats != conversations(4, 3, seed=1)
    assert all(len(c.questions) == 3 for c in chats)
    firsts = {c.system.split(".")[0] for c in chats}
    assert len(firsts) == 4  # "You are assistant i": every prompt differs from its first sentence on


def test_a_turns_request_carries_every_earlier_question_and_answer_in_order():
    chat = conversations(1, 3)[0]
    assert chat.messages(0, []) == [{"role": "system", "content": chat.system},
                                    {"role": "user", "content": chat.questions[0]}]
    third = chat.messages(2, ["a1", "a2"])
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in third[1:]] == [chat.questions[0], "a1", chat.questions[1], "a2", chat.questions[2]]


def test_think_times_are_seeded_within_half_either_side():
    pauses = think_times(3, 4, 2.0)
    assert pauses == think_times(3, 4, 2.0)
    assert all(1.0 <= p <= 3.0 for row in pauses for p in row) and len({p for row in pauses for p in row}) == 12


def test_percentiles_interpolate_between_ranks_as_numpy_does():
    values = [10.0, 20.0, 30.0, 40.0]
    assert summarize([5.0]) == {"mean": 5.0, "p50": 5.0, "p90": 5.0}
    assert summarize(values) == {"mean": statistics.fmean(values), "p50": 25.0, "p90": pytest.approx(37.0)}


def _turn(conversation: int, turn: int, ttft: float, answer: str = "a", prompt: int = 40, completion: int = 10,
          cached: int = 0) -> Turn:
    return Turn(conversation, turn, ttft, answer, prompt, completion, cached)


def test_the_working_set_is_each_conversations_last_prompt_and_answer_in_blocks():
    turns = [_turn(0, 0, 1, prompt=20), _turn(0, 1, 1, prompt=50, completion=15), _turn(1, 0, 1, prompt=16,
                                                                                         completion=1)]
    assert working_set_blocks(turns, block_size=16) == 5 + 2  # 65 tokens, then 17


def test_the_report_puts_each_configuration_against_none_and_checks_the_answers():
    none = Result("none", 10.0, [_turn(0, 0, 300), _turn(0, 1, 600)], {"prefill-0": 0, "decode-0": 0})
    shared = Result("shared", 5.0, [_turn(0, 0, 300), _turn(0, 1, 100, cached=32)], {"prefill-0": 32, "decode-0": 0})
    other = Result("disk", 10.0, [_turn(0, 0, 300), _turn(0, 1, 300, answer="b")], {"prefill-0": 16, "decode-0": 0})
    assert shared.stats()["output_tok_s"] == 4.0 and shared.stats()["ttft_later_ms"]["mean"] == 100
    text = report([none, shared, other], pool_blocks=2)
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "2.25x, 6.00x, 2.00x" in rows["shared"] and rows["shared"].endswith("| yes |")
    assert "32 of 80" in rows["shared"] and "| 32, 0 |" in rows["shared"]
    assert rows["disk"].endswith("| NO |")
    assert "working set 4 blocks of 16 tokens = 2.0x the device pool of 2 blocks" in text

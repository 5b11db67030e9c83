"""Reasoning parsers: `<think>…</think>` split off as reasoning, whole and streamed in any chunking; DeepSeek-R1's
answers start inside the reasoning (the prompt opened it), Qwen3's open the tag themselves."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import InvalidConfig
from services.router import reasoning_parsers

# (parser, answer, reasoning, content)
CASES = [
    ("qwen3", "<think>\nThe user greets.\n</think>\n\nHello!", "The user greets.", "Hello!"),
    ("qwen3", "<think>\n\n</think>\n\nHello!", None, "Hello!"),  # thinking off: an empty block
    ("qwen3", "Hello! <think> is a tag.", None, "Hello! <think> is a tag."),  # no block first: all content
    ("qwen3", "<think>Still thinking when max_tokens came", "Still thinking when max_tokens came", ""),
    ("qwen3", "<thin", None, "<thin"),
    ("deepseek_r1", "The user greets.</think>\n\nHello!", "The user greets.", "Hello!"),
    ("deepseek_r1", "<think>The user greets.</think>Hello! </think>", "The user greets.", "Hello! </think>"),
    ("deepseek_r1", "No end tag at all", "No end tag at all", ""),
]


@pytest.mark.parametrize("parser, answer, reasoning, content", CASES, ids=[f"{c[0]}-{c[1][:20]}" for c in CASES])
def test_a_whole_answer_splits_into_reasoning_and_content(parser, answer, reasoning, content):
    assert reasoning_parsers.get(parser).parse(answer) == (reasoning, content)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 60)))
def test_a_streamed_answer_splits_the_same_however_it_is_chunked(case, cuts):
    parser, answer, reasoning, content = case
    points = sorted({min(c, len(answer)) for c in cuts} | {0, len(answer)})
    stream = reasoning_parsers.get(parser).stream()
    pieces = [stream.feed(answer[a:b]) for a, b in zip(points, points[1:])] + [stream.finish()]
    assert "".join(r for r, _ in pieces).strip() == (reasoning or "")
    assert "".join(c for _, c in pieces) == content


def test_the_end_tag_is_held_back_until_known():
    stream = reasoning_parsers.get("qwen3").stream()
    assert stream.feed("<think>Hmm </th") == ("Hmm ", "")
    assert stream.feed("ink>\n\nYes") == ("", "Yes")


def test_an_unknown_reasoning_parser_is_refused_naming_the_flag():
    with pytest.raises(InvalidConfig, match="--reasoning-parser must be one of"):
        reasoning_parsers.get("o1")

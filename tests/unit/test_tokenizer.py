import random

import pytest

from common.engine.default_model import default_model_dir
from common.tokenizer import Tokenizer
from common.text_stream import REPLACEMENT_CHAR, IncrementalDetokenizer

UNICODE_TEXT = "héllo 世界 🎉🙂 naïve"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir())


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    return [detok.add(ids[i : i + chunk]).text for i in range(0, len(ids), chunk)]


def test_tokenizer_basics(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.encode("hello") == [28120]  # SmolLM2 adds no BOS
    assert tokenizer.decode(tokenizer.encode(UNICODE_TEXT)) == UNICODE_TEXT


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "empty"),
        ([{"role": "user"}], r"messages\[0\]"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\]"),
        ([{"role": "user", "content": None}], "content"),
    ],
)
def test_chat_template_rejects_bad_messages(tokenizer, messages, match):
    with pytest.raises(ValueError, match=match):
        tokenizer.apply_chat_template(messages)


def test_chat_template_missing_is_a_clear_error():
    tok = Tokenizer.from_model_dir(default_model_dir())
    tok.hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unicode_one_token_at_a_time_never_splits_characters(tokenizer):
    ids = tokenizer.encode(UNICODE_TEXT)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids), "test needs tokens that split characters"
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say it:"))
    deltas = stream(detok, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == UNICODE_TEXT == detok.text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_random_tokens_match_full_decode(tokenizer, seed, skip_special_tokens):
    rng = random.Random(seed)
    pool = tokenizer.encode(UNICODE_TEXT + " ok") + [0, 1, 2]
    ids = [rng.choice(pool) if rng.random() < 0.6 else rng.randrange(tokenizer.vocab_size) for _ in range(80)]
    prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(8))]
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = stream(detok, ids, chunk=rng.randint(1, 3))
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) + detok.flush() == expected


def test_first_token_keeps_its_leading_space(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"))
    assert detok.add(tokenizer.encode(" world")).text == " world"


def test_decode_window_does_not_grow_with_output(tokenizer):
    lengths: list[int] = []
    decode = tokenizer.decode

    class Recording(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return decode(ids, skip_special_tokens)

    recording = Recording(tokenizer.hf)
    ids = tokenizer.encode((UNICODE_TEXT + " and some more words. ") * 40)
    detok = IncrementalDetokenizer(recording, [1, 2, 3], stop=["zzz"])
    stream(detok, ids)
    assert len(ids) > 400
    assert max(lengths) <= 12


def test_stop_string_split_across_tokens(tokenizer):
    ids = tokenizer.encode("Hello wor") + tokenizer.encode("ld and more")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["world"])
    deltas = [detok.add([i]) for i in ids]
    assert "".join(d.text for d in deltas) == "Hello " == detok.text
    assert not any("wor" in d.text for d in deltas)
    matched = [d.matched_stop for d in deltas]
    first = matched.index("world")
    assert first < len(ids) - 1 and all(m is None for m in matched[:first])
    assert detok.flush() == ""


def test_stop_string_at_the_very_start(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["Hello"])
    deltas = stream(detok, tokenizer.encode("Hello there"))
    assert "".join(deltas) == "" == detok.text
    assert detok.matched_stop == "Hello"


@pytest.mark.parametrize("chunk", [1, 100])
def test_earliest_of_two_stop_strings_wins(tokenizer, chunk):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["three", "two"])
    stream(detok, tokenizer.encode("one two three four"), chunk=chunk)
    assert detok.matched_stop == "two"
    assert detok.text == "one "


def test_possible_stop_prefix_is_held_until_resolved(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["END"])
    assert "".join(stream(detok, tokenizer.encode("answer: EN"))) == "answer: "
    assert detok.add(tokenizer.encode("x")).text == "ENx"
    detok = IncrementalDetokenizer(tokenizer, [], stop=["END"])
    assert "".join(stream(detok, tokenizer.encode("answer: EN"))) == "answer: "
    assert detok.flush() == "EN"
    assert detok.text == "answer: EN" and detok.matched_stop is None


@pytest.mark.parametrize("seed", range(10))
def test_stop_strings_never_leak(tokenizer, seed):
    rng = random.Random(seed)
    text = "The café 世界 is open. Then 🎉 we go home, then we sleep."
    stops = []
    for _ in range(rng.randint(1, 3)):
        start = rng.randrange(len(text) - 1)
        stops.append(text[start : start + rng.randint(1, 6)])
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
    emitted = "".join(stream(detok, ids, chunk=rng.randint(1, 3)))
    if detok.matched_stop is None:
        emitted += detok.flush()
        assert emitted == text and not any(s in text for s in stops)
    else:
        assert text.startswith(emitted)
        assert text[len(emitted) :].startswith(detok.matched_stop)
    assert not any(s in emitted for s in stops)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_gives_transformers_text(tokenizer, skip_special_tokens):
    """Tokenizer.decode goes to the fast tokenizer's Rust core directly: the text transformers' decode gives without
    clean-up, special tokens kept or skipped."""
    rng = random.Random(7)
    pool = tokenizer.encode(UNICODE_TEXT + " ok") + [0, 1, 2]
    for _ in range(20):
        ids = [rng.choice(pool) if rng.random() < 0.6 else rng.randrange(tokenizer.vocab_size) for _ in range(40)]
        assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == tokenizer.hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

"""Hugging Face tokenizer wrapper and chat template (the text stream is common.text_stream). Torch-free: the
router and `disagg run` tokenise with it, without loading an engine."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers
from jinja2 import TemplateError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class Tokenizer:
    """Text ↔ token ids. EOS ids are a model fact (common.model_facts), not the tokenizer's."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        # A fast tokenizer's Rust core decodes for a third of the Python wrapper's cost, with the same text when no
        # clean-up is asked for; the router decodes twice per streamed token (text_stream.py).
        backend = getattr(hf, "_tokenizer", None)
        self._rust_decode = backend.decode if isinstance(backend, tokenizers.Tokenizer) else None
        self.vocab_size: int = len(hf)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> Tokenizer:
        from transformers import AutoTokenizer

        path = Path(path)
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(hf)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary string; a byte-level BPE symbol is one byte,
        so one character at most). A text of n characters needs at least n / max_token_chars tokens."""
        pieces = self.hf.convert_ids_to_tokens(list(range(self.vocab_size)))
        return max((len(p) for p in pieces if isinstance(p, str)), default=1)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), found without tokenising: a prompt that cannot fit the context is
        refused at once instead of occupying the tokenizer. Halved, for normalisers that compose characters."""
        return len(text) // (2 * self.max_token_chars)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The messages (OpenAI's shape: a tool message's tool_call_id, an assistant's tool_calls) and the tools
        the model may call, rendered by the model's chat template."""
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
        if not messages:
            raise ValueError("messages is empty; send at least one message")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(
                message.get("content"), str
            ):
                raise ValueError(f"messages[{i}] must have a string 'role' and a string 'content'")
        try:
            ids = self.hf.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
            )
        except TemplateError as exc:  # the template's own raise_exception (roles out of order, a tool call it lacks)
            raise ValueError(f"the chat template refused the messages: {exc}") from None
        return list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of spaces: it is not window-local, so incremental decoding could not match it.
        if self._rust_decode is not None:
            return self._rust_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )


def load_tokenizer(model_dir: str) -> Tokenizer | None:
    """The model's tokenizer, or None for a weights-only directory (token-id requests still work)."""
    if not any((Path(model_dir) / f).exists() for f in _TOKENIZER_FILES):
        return None
    return Tokenizer.from_model_dir(model_dir)

"""When a request stops: eos, stop token ids, stop strings, max_tokens, the context limit."""
from __future__ import annotations

import logging
from pathlib import Path

from common.engine.request import FinishReason, Request, RequestType
from common.engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model_dir: str) -> Tokenizer | None:
    """The model's tokenizer, or None for a weights-only directory (token-id requests still work)."""
    if not any((Path(model_dir) / f).exists() for f in _TOKENIZER_FILES):
        return None
    return Tokenizer.from_model_dir(model_dir)


class StopChecker:
    """Per request: detokenises the output (when a tokenizer exists) and decides when it ends."""

    def __init__(self, request: Request, eos_token_ids: frozenset[int], tokenizer: Tokenizer | None):
        self.request = request
        s = request.sampling
        self.stop_ids = set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos_token_ids))
        if s.stop and tokenizer is None:
            log.warning("request %s has stop strings but the model has no tokenizer", request.request_id)
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, request.prompt_token_ids, stop=s.stop) if tokenizer else None
        )
        if self.detokenizer and request.request_type is RequestType.GENERATION_ONLY:
            self.detokenizer.add(request.output_token_ids)  # the first token was streamed by prefill

    def check(self, token: int) -> tuple[FinishReason | None, str, str | None]:
        """(finish reason or None, new text, matched stop string) after `token` was appended."""
        text, matched = "", None
        if self.detokenizer is not None:
            delta = self.detokenizer.add([token])
            text, matched = delta.text, delta.matched_stop
        if matched is not None or token in self.stop_ids:
            return FinishReason.STOP, text, matched
        if self.request.num_tokens >= self.request.max_total_tokens:
            return FinishReason.LENGTH, text, None
        return None, text, None

    def flush(self) -> str:
        return self.detokenizer.flush() if self.detokenizer is not None else ""

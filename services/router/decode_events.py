"""Request path, decode: what a decode worker's stream tells the router, as plain events (decode_stream.py yields
them; the request's Flight applies them to what the client has been sent)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from common.pb.disagg.v1 import common_pb2
from services.router.generation import FinishReason


@dataclass(frozen=True)
class Tokens:
    """Tokens the worker generated, with their logprobs as it sent them."""

    token_ids: Sequence[int]
    logprobs: Sequence[common_pb2.TokenLogprob] = ()
    index: int = 0  # the choice (n > 1)
    prompt_logprobs: Sequence[common_pb2.TokenLogprob] = ()  # with choice 0's first tokens, when asked for


@dataclass(frozen=True)
class KvHandoff:
    """How the KV of a handoff came to the decode worker, for the client's Usage."""

    backend: str  # "" when the worker did not say
    num_bytes: int
    ms: float


@dataclass(frozen=True)
class CachedTokens:
    """The prompt tokens the decode worker's prefix cache held (a request it ran the prompt of)."""

    count: int


@dataclass(frozen=True)
class WorkerTimings:
    """The TTFT breakdown parts the decode worker measured (only from the worker whose timings are the request's)."""

    breakdown: common_pb2.TtftBreakdown


@dataclass(frozen=True)
class DecodeFinished:
    reason: FinishReason
    stop_token_id: int | None = None  # the EOS or stop token id that ended it
    choices: tuple[tuple[int, FinishReason, int | None], ...] = ()  # n > 1: (index, reason, stop token id) each


DecodeEvent = Union[Tokens, KvHandoff, CachedTokens, WorkerTimings, DecodeFinished]

"""Request state: what the caller asks for (SamplingParams) and what the engine tracks (Request)."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.engine.structured import StructuredOutput
from common.errors import InvalidRequest

if TYPE_CHECKING:  # torch lives there; the router builds SamplingParams without it
    from common.engine.grammar_backend import GrammarState
    from common.engine.multimodal import MultiModalInputs
    from common.kv.session import KvSession


class RequestType(enum.Enum):
    """TensorRT-LLM's DisaggregatedParams.request_type, one engine mode each."""

    CONTEXT_AND_GENERATION = "context_and_generation"  # aggregated: prompt and generation here
    CONTEXT_ONLY = "context_only"  # prefill: run the prompt, sample the first token, export the KV
    GENERATION_ONLY = "generation_only"  # decode: import the prompt's KV, generate from the first token


class FinishReason(enum.Enum):
    STOP = "stop"  # eos or a stop token id (stop strings: the router's text stream)
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller
    CONTEXT_DONE = "context_done"  # context_only: first token sampled, KV exported


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(frozen=True)
class SamplingParams:
    """Defaults mirror vLLM/OpenAI: temperature 1, no truncation; temperature 0 is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # None = up to the context limit
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    structured: StructuredOutput | None = None  # what the output must match (grammar-constrained decoding)
    # OpenAI's penalties, as vLLM applies them: over the tokens generated so far.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a dict is accepted and sorted
    n: int = 1  # choices, all from one prefill
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob and its top k (vLLM's name)

    MAX_TOP_LOGPROBS = 20
    MAX_N = 16  # choices share the prompt's blocks but each decodes: n multiplies a request's decode cost
    MAX_LOGIT_BIAS = 300  # entries, as OpenAI documents; each is applied to every step of the request
    MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI)
    MAX_BIAS = 100.0
    # What a request may ask for whose cost grows with its size, refused up front rather than paid by every request
    # that shares the router's event loop. Stop strings are matched at every delta (common.text_stream): OpenAI
    # takes up to 4, as TGI does by default (--max-stop-sequences); vLLM has no cap. 64 leaves room for a client
    # that lists every turn marker of a few chat formats; 4096 characters in all bound the text held back for a
    # possible match and each delta's search to microseconds. Stop token ids become a set on every worker: 1024 is
    # more than any model's special tokens.
    MAX_STOP_STRINGS = 64
    MAX_STOP_CHARS = 4096
    MAX_STOP_TOKEN_IDS = 1024

    def __post_init__(self) -> None:
        self._check_sizes()
        if isinstance(self.logit_bias, dict):  # frozen, and hashable: pairs in id order
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None),
             f"max_tokens must be >= 1, got {self.max_tokens} (0 only scores a prompt, with prompt_logprobs)"),
            (0 <= self.top_logprobs <= self.MAX_TOP_LOGPROBS,
             f"top_logprobs must be in [0, {self.MAX_TOP_LOGPROBS}], got {self.top_logprobs}"),
            (self.seed is None or 0 <= self.seed < 2**63, f"seed must be in [0, 2^63), got {self.seed}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (-self.MAX_PENALTY <= self.presence_penalty <= self.MAX_PENALTY,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-self.MAX_PENALTY <= self.frequency_penalty <= self.MAX_PENALTY,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (1 <= self.n <= self.MAX_N, f"n must be in [1, {self.MAX_N}], got {self.n}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_TOP_LOGPROBS,
             f"prompt_logprobs must be in [0, {self.MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)

    def _check_sizes(self) -> None:
        """The size limits, before anything walks an oversized field (each message starts with the field's name)."""
        if len(self.stop) > self.MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop has {len(self.stop)} strings; at most {self.MAX_STOP_STRINGS} are accepted")
        chars = sum(map(len, self.stop))
        if chars > self.MAX_STOP_CHARS:
            raise InvalidRequest(f"stop has {chars} characters in all; at most {self.MAX_STOP_CHARS} are accepted")
        if len(self.stop_token_ids) > self.MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most "
                                 f"{self.MAX_STOP_TOKEN_IDS} are accepted")
        if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias has {len(self.logit_bias)} entries; at most {self.MAX_LOGIT_BIAS} "
                                 "are accepted")
        bias = dict(self.logit_bias)
        bad = [(t, b) for t, b in bias.items() if not (isinstance(t, int) and t >= 0 and isinstance(b, (int, float))
                                                        and math.isfinite(b) and -self.MAX_BIAS <= b <= self.MAX_BIAS)]
        if bad:
            raise InvalidRequest(f"logit_bias maps token ids >= 0 to biases in [-100, 100]; got {bad[0][0]}: "
                                 f"{bad[0][1]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or biases change this request's logits before it samples (the greedy fast path skips them)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    def check_vocab(self, vocab_size: int) -> None:
        """InvalidRequest for a logit_bias token id outside the vocabulary (the router's and the engine's check)."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def check_fits_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """InvalidRequest unless the prompt leaves room for a token, and max_tokens (if set) fits what is left.
    Refused up front (as vLLM and OpenAI do) rather than capped: an unreachable max_tokens is a client mistake,
    and on a long context it would run until the client's deadline."""
    if prompt_tokens >= max_model_len:
        raise InvalidRequest(f"prompt has {prompt_tokens} tokens; the model's context is {max_model_len} "
                             "tokens, which must also hold at least one generated token")
    room = max_model_len - prompt_tokens
    if max_tokens is not None and max_tokens > room:
        raise InvalidRequest(f"max_tokens={max_tokens} with a {prompt_tokens}-token prompt exceeds the "
                             f"model's context of {max_model_len} tokens; ask for at most {room}")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Request:
    """One sequence as the engine sees it. Holds block ids, never tensors (except a pending KV import)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_type: RequestType = RequestType.CONTEXT_AND_GENERATION
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule only)
    finish_reason: FinishReason | None = None
    kv_import: object | None = None  # generation_only: common.kv.layout.KvExport until copied in
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of this request's full blocks
    max_total_tokens: int = 0  # prompt + output cap, set by the engine from max_tokens / max_model_len
    arrival_time: float = 0.0  # time.monotonic() stamps, in this process: added to the engine,
    first_scheduled_time: float | None = None  # first admitted into a step's batch,
    first_token_time: float | None = None  # its first generated token read back (a step's result)
    num_preemptions: int = 0
    mm: MultiModalInputs | None = None  # image embeddings spliced over the prompt's placeholders
    grammar: GrammarState | None = None  # sampling.structured's state, advanced by every token appended
    # n > 1: every choice is a Request; the first (the leader) runs the prompt, the others wait in `forks` until
    # its prompt's KV is complete, then take its full blocks (engine.py). They answer under the leader's id.
    index: int = 0  # the choice this request is (its seed stream and its outputs' index)
    group_id: str = ""  # the leader's request id ("" for the leader itself)
    forks: list["Request"] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. as prefill computes them
    # Speculative decoding: tokens guessed to follow this decode row's last one, which its next step computes and
    # scores beside it (common/engine/spec/speculator.py); never part of the request's tokens until accepted.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def output_id(self) -> str:
        """The id its outputs carry: the leader's for every choice."""
        return self.group_id or self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    session_id: str | None = None  # context_only: where the KV waits for its pull
    session: "KvSession | None" = None  # a copy of that session as pinned, so the caller needs no second trip
    # On the output carrying the request's first generated token (None elsewhere, and from an engine that does not
    # stamp them): Request.first_scheduled_time and first_token_time, time.monotonic() in the engine's process.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    index: int = 0  # the choice (n > 1)
    # With the first token of a request that asked for prompt_logprobs: prompt tokens 1.. (token 0 has none).
    prompt_logprobs: list[TokenLogprob] | None = None

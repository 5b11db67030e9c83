"""Request path, at both ends: the router core's plain types, what a front door hands the core (GenerationRequest) and
the events the core yields back.

Every front door (frontends/grpc.py for disagg.v1, kserve.py for KServe v2, openai.py for OpenAI HTTP) maps its
protocol onto these; the core (orchestrator, encode_prefill, decode_stream, policies) never sees a client's protobuf or
JSON. Protobuf stays at the edges: the front doors and the worker stubs.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

from common.engine.request import SamplingParams
from common.errors import InvalidRequest

# The chat template renders every message in the router's one tokenizing thread, ahead of every other request's
# prompt, however short the messages: 2048 empty ones take ~0.13 s with SmolLM2's template (20000, 1.2 s).
MAX_MESSAGES = 2048


def check_message_count(count: int) -> None:
    """InvalidRequest past MAX_MESSAGES: called by each front door before it walks the messages, and by
    GenerationRequest for any that does not."""
    if count > MAX_MESSAGES:
        raise InvalidRequest(f"messages has {count} messages; at most {MAX_MESSAGES} are accepted")


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the end of the context
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class ImageInput:
    """One image, as exactly one of: encoded bytes, a `data:` URL, or a path / http(s) URL (the encode
    worker opens paths only inside --allowed-media-dir and fetches URLs only with --allow-url-fetch)."""

    data: bytes | None = None
    data_url: str | None = None
    path: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """A function call: one the model made earlier (in an assistant message) or one parsed from its output."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI carries it


@dataclass(frozen=True)
class Tool:
    """A function the model may call, described to it by the chat template."""

    name: str
    description: str = ""
    parameters: str = ""  # its JSON schema, as JSON text ("": none given)

    def template_dict(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "description": self.description}
        if self.parameters:
            function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None  # a tool message: the function that answered

    def template_dict(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates read it; a call's arguments as an object where they parse
        as one (templates write them with `tojson`), as vLLM passes them."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": _arguments_value(c.arguments)}}
                                     for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _arguments_value(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


@dataclass(frozen=True)
class GenerationRequest:
    """One request, whichever front door it came through. Exactly one of prompt, token_ids, messages is set
    (the core says so with INVALID_ARGUMENT otherwise)."""

    request_id: str
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None  # rendered with the model's chat template
    tools: tuple[Tool, ...] = ()  # with messages: the functions the chat template describes to the model
    model: str = ""  # empty: the served model
    images: tuple[ImageInput, ...] = ()
    params: SamplingParams = field(default_factory=SamplingParams)  # sampling, stop conditions, logprobs
    echo_prompt_token_ids: bool = False
    timeout_ms: int = 0  # 0: no deadline of its own (the RPC's, if any, still applies)

    def __post_init__(self) -> None:
        if self.messages is not None:
            check_message_count(len(self.messages))


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float
    text: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: a prompt's first token (TextDelta.prompt_logprobs)
    text: str = ""
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class TextDelta:
    """Newly generated tokens and the text they complete (text may lag a token: incremental detokenising)."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token when the request asked for logprobs
    prompt_token_ids: tuple[int, ...] = ()  # on the first delta, when the request asked to echo the prompt
    index: int = 0  # the choice (SamplingParams.n > 1)
    # On a choice's first delta, when the request asked for prompt_logprobs: every prompt token (the first: None).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class TtftBreakdown:
    """Where a request's time to first token went, in ms; disagg.v1.TtftBreakdown defines each part. None: the part
    does not apply (kv_handoff and first_decode_step without a prefill worker) or was not measured (no first token).
    The first three are on the first token's path; the last two come after it, before decode's first token."""

    router_queue_ms: float | None = None
    prefill_queue_ms: float | None = None
    prefill_compute_ms: float | None = None
    kv_handoff_ms: float | None = None
    first_decode_step_ms: float | None = None

    def parts(self) -> dict[str, float]:
        """The measured parts, by field name, in the request's order."""
        return {name: ms for name, ms in vars(self).items() if ms is not None}

    @property
    def to_first_token_ms(self) -> float:
        """router queue + prefill queue + prefill compute: the client's TTFT less the transit of the prompt's call."""
        return sum(ms or 0.0 for ms in (self.router_queue_ms, self.prefill_queue_ms, self.prefill_compute_ms))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    kv_transfer_backend: str = ""  # "cuda_ipc", "shm", "nixl", "grpc", "trtllm"; "" without a KV handoff
    kv_transfer_bytes: int = 0
    kv_transfer_ms: float = 0.0
    ttft_breakdown: TtftBreakdown = field(default_factory=TtftBreakdown)


@dataclass(frozen=True)
class ChoiceEnd:
    """How one choice of a request with n > 1 ended (Finished.choices)."""

    index: int
    reason: FinishReason
    completion_tokens: int = 0
    matched_stop: str = ""
    matched_stop_token_id: int | None = None


@dataclass(frozen=True)
class Finished:
    """The last event of a request. With n > 1, `choices` says how each ended (the fields above: choice 0; usage
    sums every choice's tokens)."""

    reason: FinishReason
    usage: Usage
    matched_stop: str = ""  # the stop string that ended it
    matched_stop_token_id: int | None = None  # the EOS or stop token id that ended it
    error: BaseException | None = None  # reason ERROR: the typed error (common.errors) or a worker's status
    choices: tuple[ChoiceEnd, ...] = ()


Event = Union[TextDelta, Finished]


@dataclass(frozen=True)
class ServedModel:
    """The model as the workers announce it (GetInfo), and what the router knows of its inputs."""

    name: str
    max_model_len: int
    image_token: str | None = None  # the text that marks where an image goes; None: the model takes no images

    @property
    def supports_images(self) -> bool:
        return self.image_token is not None


class EventStream(Protocol):
    """One request's events, as the core hands them to a front door: TextDelta events, then one Finished. Closing it
    early (aclose) cancels the request, frees what it holds on every worker and counts it as CANCELLED."""

    def __aiter__(self) -> "EventStream": ...

    async def __anext__(self) -> Event: ...

    async def aclose(self) -> None: ...

    def cancel(self) -> None:
        """End the request now: the stream's next event is Finished(CANCELLED) (a no-op once it ended)."""

    def failed(self, exc: BaseException) -> Finished:
        """Finished(ERROR) for an error the stream raised, with the usage so far."""


class Core(Protocol):
    """What every front door needs of the router core (services/router/orchestrator.py's Orchestrator)."""

    def served_model(self) -> ServedModel: ...

    def ready(self) -> bool: ...

    def stream(self, request: GenerationRequest, timeout_s: float | None = None) -> EventStream:
        """The request's events; it starts when first iterated. Failures raise the typed error (common.errors)."""

    def rejected(self, exc: BaseException) -> None:
        """Count a request the front door refused before calling `stream`, under its status."""

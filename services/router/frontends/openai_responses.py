"""The JSON OpenAI clients read: chat and completion responses and stream chunks, usage, logprobs, and errors
(`{"error": {message, type, param, code}}` with the HTTP status the core's error maps to)."""
from __future__ import annotations

from typing import Any

import grpc

from services.router.frontends.openai_chat_output import ChatOutput
from services.router.frontends.openai_fields import BadField, ModelNotFound
from services.router.frontends.openai_requests import CHAT, ApiRequest
from services.router.generation import Finished, TextDelta, TokenLogprob, Usage
from services.kit.serving import message_of, status_of

Json = dict[str, Any]
INTERNAL_MESSAGE = "internal server error; the router's log has the details"

_S = grpc.StatusCode
# The one table from the core's status (services.kit.serving.status_of) to HTTP: (status, OpenAI error type, code).
_HTTP_OF: dict[grpc.StatusCode, tuple[int, str, str]] = {
    _S.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_request"),
    _S.OUT_OF_RANGE: (400, "invalid_request_error", "invalid_request"),
    _S.FAILED_PRECONDITION: (400, "invalid_request_error", "failed_precondition"),
    _S.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    _S.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    _S.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
    _S.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
    _S.CANCELLED: (503, "service_unavailable_error", "cancelled"),  # a worker gave up our call: retryable
    _S.UNIMPLEMENTED: (501, "server_error", "not_implemented"),
}
_INTERNAL = (500, "server_error", "internal_error")


def error_json(message: str, type_: str, code: str, param: str | None = None) -> Json:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_of(exc: BaseException) -> tuple[int, Json]:
    """HTTP status and error JSON for anything the core or the parsing raised; a status we do not expect is a
    500 whose message hides the internals (the caller logs them)."""
    http_status, type_, code = _HTTP_OF.get(status_of(exc), _INTERNAL)
    if http_status == 500:
        return http_status, error_json(INTERNAL_MESSAGE, type_, code)
    param = None
    if isinstance(exc, (BadField, ModelNotFound)):
        param, code = exc.param or None, exc.code
    return http_status, error_json(message_of(exc) or type(exc).__name__, type_, code, param)


def usage_json(usage: Usage) -> Json:
    usage_of = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}
    parts = usage.ttft_breakdown.parts()
    if parts:  # ours, not OpenAI's (clients ignore unknown fields): disagg.v1.TtftBreakdown's parts, in ms
        usage_of["ttft_breakdown"] = parts
        if usage.ttft_ms:  # the router's own TTFT: a client tells its side of the time from the router's
            usage_of["ttft_ms"] = usage.ttft_ms
    return usage_of


def _chat_logprobs(logprobs: tuple[TokenLogprob, ...]) -> Json:
    def entry(text: str, logprob: float) -> Json:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**entry(t.text, t.logprob), "top_logprobs": [entry(top.text, top.logprob) for top in t.top]}
                        for t in logprobs]}


class _ChoiceState:
    """One choice's running state: its chat output's parser, its completions text offset."""

    def __init__(self, api: ApiRequest):
        self.output = ChatOutput(api.output)  # chat: reasoning and tool calls read out of the text
        self.offset = 0


class Shapes:
    """One request's response JSON, streamed (chunks) or whole. Chat and completions differ only in the choice's
    text field and in the logprobs shape; completions' `text_offset` counts across chunks, hence the state (one per
    choice: n > 1 streams every choice under its index). Completions' echo puts the prompt's text, and with
    logprobs its tokens' logprobs (the first null), before each choice's own."""

    def __init__(self, api: ApiRequest, request_id: str, created: int):
        self.chat = api.kind == CHAT
        params = api.generation.params
        self.logprobs = params.logprobs
        self.include_usage = api.include_usage
        self._head = {"id": ("chatcmpl-" if self.chat else "cmpl-") + request_id,
                      "object": "chat.completion" if self.chat else "text_completion",
                      "created": created, "model": api.generation.model}
        self._echo = api.echo
        self._prompt_text = api.generation.prompt  # None: token ids, whose text comes with their logprobs
        self._vllm_prompt_logprobs = params.prompt_logprobs is not None and not api.echo
        self._choices = [_ChoiceState(api) for _ in range(params.n)]

    def opening(self) -> list[Json]:
        """The first chat chunk of each choice carries the role (completions have no opening chunk)."""
        if not self.chat:
            return []
        return [self._chunk({"delta": {"role": "assistant", "content": ""}}, i) for i in range(len(self._choices))]

    def delta(self, delta: TextDelta) -> Json | None:
        state = self._choices[delta.index]
        fields = state.output.delta(delta.text) if self.chat else {}
        text, logprobs = delta.text, delta.logprobs
        if self._echo and delta.prompt_token_ids:
            text, logprobs = self._echoed(delta) + text, self._echoed_logprobs(delta) + logprobs
        # A completion streams an event a token, its text "" while held back (a partial character, a stop string),
        # as vLLM's does: a client timing events (vLLM's bench, aiperf) then sees the token cadence. A chat chunk
        # waits for something to say (text held back by a partial character, stop string, tag or call).
        if not (fields if self.chat else text or delta.token_ids) and not logprobs:
            return None
        body = {"delta": fields} if self.chat else {"text": text}
        extra = self._prompt_logprobs_json(delta)
        return self._chunk({**body, "logprobs": self._logprobs(logprobs, state), **extra}, delta.index)

    def finish(self, finished: Finished) -> list[Json]:
        chunks = []
        reasons = {c.index: c.reason.value for c in finished.choices}
        for index, state in enumerate(self._choices):
            held = state.output.finish() if self.chat else {}
            chunks += [self._chunk({"delta": held}, index)] if held else []
            text = {"delta": {}} if self.chat else {"text": ""}
            reason = reasons.get(index, finished.reason.value)
            chunks.append(self._chunk({**text, "finish_reason": state.output.finish_reason(reason)}, index))
        if self.include_usage:
            chunks.append({**self._head, "object": self._chunk_object, "choices": [],
                           "usage": usage_json(finished.usage)})
        return chunks

    def response(self, deltas: list[TextDelta], finished: Finished) -> Json:
        reasons = {c.index: c.reason.value for c in finished.choices}
        choices = []
        for index, state in enumerate(self._choices):
            mine = [d for d in deltas if d.index == index]
            text = "".join(d.text for d in mine)
            tokens = tuple(t for d in mine for t in d.logprobs)
            if mine and self._echo and mine[0].prompt_token_ids:
                text, tokens = self._echoed(mine[0]) + text, self._echoed_logprobs(mine[0]) + tokens
            extra = self._prompt_logprobs_json(mine[0]) if mine else {}
            body = {"message": state.output.message(text)} if self.chat else {"text": text}
            choices.append({"index": index, **body, "logprobs": self._logprobs(tokens, state),
                            "finish_reason": state.output.finish_reason(reasons.get(index, finished.reason.value)),
                            **extra})
        return {**self._head, "choices": choices, "usage": usage_json(finished.usage)}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choice: Json, index: int = 0) -> Json:
        chunk = {**self._head, "object": self._chunk_object,
                 "choices": [{"index": index, "logprobs": None, "finish_reason": None, **choice}]}
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: every chunk but the last has a null usage
        return chunk

    def _echoed(self, delta: TextDelta) -> str:
        if self._prompt_text is not None:
            return self._prompt_text
        return "".join(t.text for t in delta.prompt_logprobs)

    def _echoed_logprobs(self, delta: TextDelta) -> tuple[TokenLogprob, ...]:
        return delta.prompt_logprobs if self.logprobs else ()

    def _prompt_logprobs_json(self, delta: TextDelta) -> Json:
        """vLLM's `prompt_logprobs` (asked for without echo): per prompt token, null for the first, else its id and
        its top alternatives' ids → {logprob, decoded_token}."""
        if not self._vllm_prompt_logprobs or not delta.prompt_logprobs:
            return {}
        def entry(t: TokenLogprob) -> Json | None:
            if t.logprob is None:
                return None
            tops = {str(top.token_id): {"logprob": top.logprob, "decoded_token": top.text} for top in t.top}
            return {str(t.token_id): {"logprob": t.logprob, "decoded_token": t.text}, **tops}
        return {"prompt_logprobs": [entry(t) for t in delta.prompt_logprobs]}

    def _logprobs(self, logprobs: tuple[TokenLogprob, ...], state: _ChoiceState) -> Json | None:
        if not self.logprobs:
            return None
        if self.chat:
            return _chat_logprobs(logprobs)
        offsets = []
        for t in logprobs:
            offsets.append(state.offset)
            state.offset += len(t.text)
        return {"tokens": [t.text for t in logprobs], "token_logprobs": [t.logprob for t in logprobs],
                "top_logprobs": [{top.text: top.logprob for top in t.top} if t.logprob is not None else None
                                 for t in logprobs], "text_offset": offsets}

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
    return usage_of


def _chat_logprobs(logprobs: tuple[TokenLogprob, ...]) -> Json:
    def entry(text: str, logprob: float) -> Json:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**entry(t.text, t.logprob), "top_logprobs": [entry(top.text, top.logprob) for top in t.top]}
                        for t in logprobs]}


class Shapes:
    """One request's response JSON, streamed (chunks) or whole. Chat and completions differ only in the choice's
    text field and in the logprobs shape; completions' `text_offset` counts across chunks, hence the state."""

    def __init__(self, api: ApiRequest, request_id: str, created: int):
        self.chat = api.kind == CHAT
        self.logprobs = api.generation.params.logprobs
        self.include_usage = api.include_usage
        self._head = {"id": ("chatcmpl-" if self.chat else "cmpl-") + request_id,
                      "object": "chat.completion" if self.chat else "text_completion",
                      "created": created, "model": api.generation.model}
        self._offset = 0
        self._output = ChatOutput(api.output)  # chat: reasoning and tool calls read out of the text

    def opening(self) -> list[Json]:
        """The first chat chunk carries the role (completions have no opening chunk)."""
        return [self._chunk({"delta": {"role": "assistant", "content": ""}})] if self.chat else []

    def delta(self, delta: TextDelta) -> Json | None:
        fields = self._output.delta(delta.text) if self.chat else {}
        if not (fields if self.chat else delta.text) and not delta.logprobs:
            return None  # tokens whose text is still held back (a partial character, stop string, tag or call)
        text = {"delta": fields} if self.chat else {"text": delta.text}
        return self._chunk({**text, "logprobs": self._logprobs(delta.logprobs)})

    def finish(self, finished: Finished) -> list[Json]:
        held = self._output.finish() if self.chat else {}
        chunks = [self._chunk({"delta": held})] if held else []
        text = {"delta": {}} if self.chat else {"text": ""}
        chunks.append(self._chunk({**text, "finish_reason": self._output.finish_reason(finished.reason.value)}))
        if self.include_usage:
            chunks.append({**self._head, "object": self._chunk_object, "choices": [],
                           "usage": usage_json(finished.usage)})
        return chunks

    def response(self, deltas: list[TextDelta], finished: Finished) -> Json:
        text = "".join(d.text for d in deltas)
        logprobs = self._logprobs(tuple(t for d in deltas for t in d.logprobs))
        body = {"message": self._output.message(text)} if self.chat else {"text": text}
        choice = {"index": 0, **body, "logprobs": logprobs,
                  "finish_reason": self._output.finish_reason(finished.reason.value)}
        return {**self._head, "choices": [choice], "usage": usage_json(finished.usage)}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choice: Json) -> Json:
        chunk = {**self._head, "object": self._chunk_object,
                 "choices": [{"index": 0, "logprobs": None, "finish_reason": None, **choice}]}
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: every chunk but the last has a null usage
        return chunk

    def _logprobs(self, logprobs: tuple[TokenLogprob, ...]) -> Json | None:
        if not self.logprobs:
            return None
        if self.chat:
            return _chat_logprobs(logprobs)
        offsets = []
        for t in logprobs:
            offsets.append(self._offset)
            self._offset += len(t.text)
        return {"tokens": [t.text for t in logprobs], "token_logprobs": [t.logprob for t in logprobs],
                "top_logprobs": [{top.text: top.logprob for top in t.top} for t in logprobs], "text_offset": offsets}

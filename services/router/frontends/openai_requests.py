"""OpenAI request bodies (/v1/chat/completions, /v1/completions) → the core's GenerationRequest.

Every check here names the field it refuses; the core then checks what needs the tokenizer and the model (empty
prompt, prompt or max_tokens beyond the context).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from common.engine.request import SamplingParams
from common.errors import InvalidRequest
from services.router.frontends.openai_chat_output import OutputParsing
from services.router.frontends.openai_fields import BadField, Fields, ModelNotFound, refuse_unsupported
from services.router.frontends.structured_fields import structured_output
from services.router.frontends.openai_tools import (ChatParsing, chat_message, constrain, for_template, read_tools,
                                                    refuse_tools)
from services.router.generation import ChatMessage, GenerationRequest, ImageInput, ServedModel, check_message_count

CHAT = "chat"
COMPLETION = "completion"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions; chat runs to the context
MAX_COMPLETION_LOGPROBS = SamplingParams.MAX_TOP_LOGPROBS
# OpenAI's newer "developer" role is its system role; "function" is the older "tool".
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
          "function": "tool"}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "max_tokens", "stop",
                    "stop_token_ids", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "n",
                    "prompt_logprobs")


@dataclass(frozen=True)
class ApiRequest:
    """A parsed request: what to ask the core, and how to answer (stream or not, usage chunk, logprobs)."""

    kind: str  # CHAT or COMPLETION
    generation: GenerationRequest
    stream: bool
    include_usage: bool
    output: OutputParsing = OutputParsing()  # chat: how the answer is read (reasoning, tool calls)
    echo: bool = False  # completions: the prompt's text (and logprobs) before each choice's


def decode_body(raw: bytes) -> Fields:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return Fields(body)


def check_model(requested: str | None, served: ServedModel) -> str:
    if requested is not None and requested != served.name:
        raise ModelNotFound(f"the model {requested!r} does not exist; this server serves {served.name!r}")
    return served.name


def parse_chat(fields: Fields, request_id: str, served: ServedModel, chat: ChatParsing = ChatParsing()
               ) -> ApiRequest:
    common = _common(fields, served)
    if fields.boolean("echo"):
        raise fields.bad("echo", "is a /v1/completions field; chat answers never repeat the conversation")
    logprobs = bool(fields.boolean("logprobs"))
    top_logprobs = fields.integer("top_logprobs", minimum=0)
    if top_logprobs and not logprobs:
        raise fields.bad("top_logprobs", "needs 'logprobs': true")
    images: list[ImageInput] = []
    tools = read_tools(fields)
    messages, offered = for_template(_messages(fields, served, images), tools, chat)
    max_tokens = fields.integer("max_completion_tokens", minimum=1)  # the newer name wins over max_tokens
    params = constrain(_sampling(fields, max_tokens, logprobs, top_logprobs or 0, "top_logprobs"), tools, chat)
    return _request(CHAT, fields, GenerationRequest(
        request_id, messages=messages, tools=offered, images=tuple(images), params=params, **common),
        OutputParsing.of(chat, tools))


def parse_completion(fields: Fields, request_id: str, served: ServedModel) -> ApiRequest:
    common = _common(fields, served)
    refuse_tools(fields)
    # Completions' logprobs is how many alternatives to return per token (OpenAI allows 0-5; we go to our cap).
    top = fields.integer("logprobs", minimum=0)
    if top is not None and top > MAX_COMPLETION_LOGPROBS:
        raise fields.bad("logprobs", f"must be in [0, {MAX_COMPLETION_LOGPROBS}], got {top}")
    # echo: the prompt before the completion, with its logprobs when `logprobs` is set; max_tokens 0 with echo
    # scores a text (log-likelihood evaluation: lm-eval-harness sends echo, max_tokens 0 and logprobs).
    echo = bool(fields.boolean("echo"))
    max_tokens = fields.integer("max_tokens", minimum=0 if echo else 1)
    scored = fields.integer("prompt_logprobs", minimum=0)
    prompt = _prompt(fields)
    if echo and (top is not None or max_tokens == 0 or "token_ids" in prompt):  # (token ids: their text too)
        scored = max(scored or 0, top or 0)
    params = _sampling(fields, COMPLETION_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                       top is not None, top or 0, "logprobs", scored)
    api = _request(COMPLETION, fields, GenerationRequest(
        request_id, params=params, echo_prompt_token_ids=echo, **prompt, **common))
    return dataclasses.replace(api, echo=echo)


def _common(fields: Fields, served: ServedModel) -> dict[str, Any]:
    """What both endpoints read the same way: model, refused fields, best_of, the deadline."""
    model = check_model(fields.string("model"), served)
    refuse_unsupported(fields)
    best_of = fields.integer("best_of")
    if best_of is not None and best_of != (fields.integer("n") or 1):
        raise fields.bad("best_of", f"must equal n: this server returns every choice it generates, got {best_of}")
    return {"model": model, "timeout_ms": fields.integer("timeout_ms", minimum=0) or 0}


def _request(kind: str, fields: Fields, generation: GenerationRequest,
             output: OutputParsing = OutputParsing()) -> ApiRequest:
    stream = bool(fields.boolean("stream"))
    options = fields.object("stream_options")
    if options is not None and not stream:
        raise fields.bad("stream_options", "is only allowed with 'stream': true")
    include_usage = bool(options and options.boolean("include_usage"))
    return ApiRequest(kind, generation, stream, include_usage, output)


def _sampling(fields: Fields, max_tokens: int | None, logprobs: bool, top_logprobs: int,
              top_name: str, prompt_logprobs: int | None = None) -> SamplingParams:
    if max_tokens is None:
        max_tokens = fields.integer("max_tokens", minimum=1)
    top_k = fields.integer("top_k")
    values = {
        "temperature": fields.number("temperature"), "top_p": fields.number("top_p"),
        "top_k": 0 if top_k == -1 else top_k,  # vLLM spells "off" -1, we spell it 0
        "min_p": fields.number("min_p"), "seed": fields.integer("seed"),
        "repetition_penalty": fields.number("repetition_penalty"), "max_tokens": max_tokens,
        "stop": fields.strings("stop"), "stop_token_ids": fields.integers("stop_token_ids"),
        "ignore_eos": fields.boolean("ignore_eos"), "logprobs": logprobs, "top_logprobs": top_logprobs,
        "presence_penalty": fields.number("presence_penalty"), "frequency_penalty": fields.number("frequency_penalty"),
        "logit_bias": _logit_bias(fields), "n": fields.integer("n"),
        "prompt_logprobs": fields.integer("prompt_logprobs", minimum=0) if prompt_logprobs is None else prompt_logprobs,
    }
    values["structured"] = structured_output(fields.body)  # response_format, guided_*
    try:
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})
    except InvalidRequest as exc:  # its message starts with the field it refuses
        field = str(exc).split(" ", 1)[0]
        param = top_name if field == "top_logprobs" else field
        raise BadField(param if field in _SAMPLING_FIELDS else "", str(exc)) from None


def _logit_bias(fields: Fields) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids as strings (JSON keys) → numbers. Its size is checked before it is read."""
    bias = fields.object("logit_bias")
    if bias is None:
        return None
    if len(bias.body) > SamplingParams.MAX_LOGIT_BIAS:
        raise fields.bad("logit_bias", f"has {len(bias.body)} entries; at most {SamplingParams.MAX_LOGIT_BIAS} are "
                                       "accepted")
    out = {}
    for key in bias.body:
        if not key.isdigit():
            raise fields.bad("logit_bias", f"keys are token ids (decimal strings), got {key!r}")
        value = bias.number(key)
        if value is None:
            raise bias.bad(key, "must be a number (a bias in [-100, 100])")
        out[int(key)] = value
    return out


def _prompt(fields: Fields) -> dict[str, Any]:
    """A string, token ids, or an array holding exactly one of these."""
    value = fields.body.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return {"prompt": value}
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        raise fields.bad("prompt", f"holds {len(value)} prompts; this server takes one per request (send them "
                                   "as separate requests)")
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in value):
        return {"token_ids": tuple(value)}
    if value == []:
        raise fields.bad("prompt", "must not be empty")
    raise fields.bad("prompt", "must be a string, an array of non-negative token ids, or an array holding one "
                               "of these" + ("" if "prompt" in fields.body else " (it is required)"))


def _messages(fields: Fields, served: ServedModel, images: list[ImageInput]) -> tuple[ChatMessage, ...]:
    items = fields.array("messages", required=True)
    if not items:
        raise fields.bad("messages", "must hold at least one message")
    try:
        check_message_count(len(items))  # before walking them
    except InvalidRequest as exc:
        raise BadField("messages", str(exc)) from None
    messages = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise fields.bad(f"messages[{i}]", "must be an object with 'role' and 'content'")
        message = Fields(item, f"messages[{i}].")
        role = message.string("role", required=True)
        if role not in _ROLES:
            raise message.bad("role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
        messages.append(chat_message(message, _ROLES[role], lambda: _content(message, role, served, images)))
    return tuple(messages)


def _content(message: Fields, role: str, served: ServedModel, images: list[ImageInput]) -> str:
    """A string, or text and image parts joined by newlines, each image part replaced by the model's image
    token so that the image lands where the client put it."""
    value = message.body.get("content")
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise message.bad("content", "must be a string or an array of content parts")
    pieces = []
    for j, part in enumerate(value):
        where = f"content[{j}]"
        if not isinstance(part, dict):
            raise message.bad(where, "must be an object with a 'type'")
        kind = part.get("type")
        if kind == "text":
            pieces.append(Fields(part, message.name(where) + ".").string("text", required=True))
        elif kind == "image_url":
            pieces.append(_image(Fields(part, message.name(where) + "."), role, served, images))
        else:
            raise message.bad(where + ".type", f"must be 'text' or 'image_url', got {kind!r}")
    return "\n".join(pieces)


def _image(part: Fields, role: str, served: ServedModel, images: list[ImageInput]) -> str:
    token = served.image_token
    if token is None:
        raise part.bad("image_url", f"cannot be honoured: the model {served.name!r} takes no images")
    if role != "user":
        raise part.bad("image_url", f"is allowed only in user messages, not in {role!r} messages")
    url = part.body.get("image_url")
    if isinstance(url, dict):
        url = Fields(url, part.name("image_url") + ".").string("url", required=True)
    if not isinstance(url, str):
        raise part.bad("image_url", "must be an object with a 'url' string")
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        images.append(ImageInput(data_url=url))
    elif scheme in ("http", "https"):
        images.append(ImageInput(path=url))  # the encode worker fetches it only with --allow-url-fetch
    else:
        raise part.bad("image_url.url", f"must be a data: URL or an http(s) URL, got scheme {scheme!r}")
    return token

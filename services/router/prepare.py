"""Request path, the core's first step: GenerationRequest → a validated, tokenised request, before any worker is
touched."""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from common.engine.request import SamplingParams, check_fits_context
from common.errors import InvalidRequest, NotFound
from common.model_facts import ModelFacts, load_model_facts
from common.tokenizer import Tokenizer, load_tokenizer
from services.router.generation import GenerationRequest, ImageInput, ServedModel
from services.router.images import ImageTokens


def _image_tokens(facts: ModelFacts, tokenizer: Tokenizer | None) -> ImageTokens | None:
    if facts.image_token_id is None:
        return None
    token = tokenizer.hf.convert_ids_to_tokens(facts.image_token_id) if tokenizer else "<image>"
    return ImageTokens(facts.image_token_id, token, facts.num_image_tokens)


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    # Unique towards the workers: two clients may both call their request "r1".
    worker_request_id: str
    prompt: list[int]
    max_model_len: int
    params: SamplingParams
    echo_prompt_token_ids: bool = False
    images: tuple[ImageInput, ...] = ()


class RequestPreparer:
    def __init__(self, tokenizer: Tokenizer | None, facts: ModelFacts):
        self.tokenizer = tokenizer
        self.facts = facts
        self.image_tokens = _image_tokens(facts, tokenizer)  # None: the model takes no images

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "RequestPreparer":
        tokenizer = load_tokenizer(str(model_dir))
        if tokenizer is not None:
            tokenizer.max_token_chars  # a scan of the vocabulary (30 ms at 49k ids) the first request would pay
        return cls(tokenizer, load_model_facts(model_dir))

    def prepare(self, request: GenerationRequest, model: ServedModel) -> PreparedRequest:
        """Raises NotFound (unknown model) or InvalidRequest (what was wrong and which limit applies)."""
        if request.model and request.model != model.name:
            raise NotFound(f"unknown model {request.model!r}; this router serves {model.name!r} "
                           "(or leave model empty for the default)")
        if request.images and self.image_tokens is None:
            raise InvalidRequest(f"model {model.name!r} does not accept images")
        params = request.params
        bad_stops = [t for t in params.stop_token_ids if t >= self.facts.vocab_size]
        if bad_stops:  # the engine would never match them; say so instead of silently ignoring
            raise InvalidRequest(f"stop_token_ids outside the vocabulary [0, {self.facts.vocab_size}): {bad_stops[:5]}")
        params.check_vocab(self.facts.vocab_size)
        self._refuse_oversized_text(request, model)
        prompt = self._tokens(request)
        if self.image_tokens is not None and (request.images or self.image_tokens.token_id in prompt):
            prompt = self.image_tokens.expand(prompt, len(request.images))
        check_fits_context(len(prompt), params.max_tokens, model.max_model_len)
        return PreparedRequest(request_id=request.request_id,
                               worker_request_id=f"{request.request_id}-{secrets.token_hex(4)}",
                               prompt=prompt, max_model_len=model.max_model_len, params=params,
                               echo_prompt_token_ids=request.echo_prompt_token_ids, images=tuple(request.images))

    def _refuse_oversized_text(self, request: GenerationRequest, model: ServedModel) -> None:
        """A text that cannot fit the context whatever its tokens is refused before it is tokenised: a 15 MB prompt
        would hold the tokenizer (and every request queued behind it) for seconds."""
        if self.tokenizer is None:
            return
        texts = [request.prompt] if request.prompt is not None else [
            text for m in request.messages or () for text in (m.content, *(c.arguments for c in m.tool_calls))]
        texts += [t.description + t.parameters for t in request.tools]  # the template writes them into the prompt
        fewest = sum(self.tokenizer.fewest_tokens(t) for t in texts)
        if fewest >= model.max_model_len:
            chars = sum(len(t) for t in texts)
            raise InvalidRequest(f"the prompt has {chars} characters, at least {fewest} tokens; the model's context "
                                 f"is {model.max_model_len} tokens, which must also hold at least one generated token")

    def _tokens(self, request: GenerationRequest) -> list[int]:
        inputs = [name for name in ("prompt", "token_ids", "messages") if getattr(request, name) is not None]
        if len(inputs) != 1:
            raise InvalidRequest("the request has no input; set one of prompt, token_ids or chat" if not inputs
                                 else f"the request sets {' and '.join(inputs)}; set exactly one")
        if request.token_ids is not None:
            return self._checked_ids(list(request.token_ids))
        if request.prompt is not None:
            tokenizer = self._require_tokenizer("prompt")
            if not request.prompt:
                raise InvalidRequest("prompt is empty")
            return tokenizer.encode(self._marked(request.prompt, len(request.images)))
        tokenizer = self._require_tokenizer("chat")
        messages = [m.template_dict() for m in request.messages]
        for i, message in enumerate(messages):
            if not message["role"]:  # the template would render a turn nobody said
                raise InvalidRequest(f"chat: messages[{i}] needs a role (system, user, assistant, ...)")
        if request.images and self.image_tokens is not None:
            messages = self.image_tokens.mark_messages(messages, len(request.images))
        try:
            return tokenizer.apply_chat_template(messages, tools=[t.template_dict() for t in request.tools] or None)
        except ValueError as exc:
            raise InvalidRequest(f"chat: {exc}") from exc

    def _marked(self, text: str, num_images: int) -> str:
        if not num_images or self.image_tokens is None:
            return text
        return self.image_tokens.mark_text(text, num_images)

    def _checked_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidRequest("token_ids is empty")
        bad = [t for t in ids if t < 0 or t >= self.facts.vocab_size]
        if bad:
            raise InvalidRequest(f"token ids outside the vocabulary [0, {self.facts.vocab_size}): {bad[:5]}")
        return ids

    def _require_tokenizer(self, kind: str) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidRequest(f"this model has no tokenizer, so {kind} input is not supported; send token_ids")
        return self.tokenizer

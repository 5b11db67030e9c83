"""disagg.v1 protobuf ↔ the router core's plain types (services/router/generation.py), for the gRPC front door."""
from __future__ import annotations

from common.kv.offer import DATA_PLANE_NUMBERS, ENGINE_DRIVEN_NUMBERS
from common.pb.disagg.v1 import common_pb2, generation_pb2
from services.kit.convert import sampling_from_proto
from services.router.generation import (ChatMessage, Event, Finished, FinishReason, GenerationRequest, ImageInput,
                                        TextDelta, TokenLogprob, Usage, check_message_count)
from services.kit.serving import message_of, status_of

_FINISH_REASONS = {FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
                   FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
                   FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
                   FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR}
_BACKEND_NUMBERS = {**DATA_PLANE_NUMBERS, **ENGINE_DRIVEN_NUMBERS}


def request_from_proto(request: generation_pb2.GenerateRequest, request_id: str) -> GenerationRequest:
    """Raises InvalidRequest (naming the field) for bad sampling values."""
    kind = request.WhichOneof("input")
    inputs: dict = {}
    if kind == "prompt":
        inputs["prompt"] = request.prompt
    elif kind == "token_ids":
        inputs["token_ids"] = tuple(request.token_ids.ids)
    elif kind == "chat":
        check_message_count(len(request.chat.messages))  # before building them
        inputs["messages"] = tuple(ChatMessage(m.role, m.content) for m in request.chat.messages)
    return GenerationRequest(
        request_id=request_id, model=request.model, images=tuple(_image(i) for i in request.images),
        params=sampling_from_proto(request.sampling, request.stop, request.output),
        echo_prompt_token_ids=request.output.echo_prompt_token_ids, timeout_ms=request.timeout_ms, **inputs)


def _image(image: common_pb2.Image) -> ImageInput:
    kind = image.WhichOneof("source")
    return ImageInput(**{kind: getattr(image, kind)}) if kind is not None else ImageInput()


def response_of(request_id: str, event: Event) -> generation_pb2.GenerateResponse:
    if isinstance(event, TextDelta):
        return generation_pb2.GenerateResponse(request_id=request_id, delta=delta_to_proto(event))
    return generation_pb2.GenerateResponse(request_id=request_id, finished=finished_to_proto(event))


def delta_to_proto(delta: TextDelta) -> common_pb2.Delta:
    return common_pb2.Delta(token_ids=delta.token_ids, text=delta.text,
                            logprobs=[_logprob(lp) for lp in delta.logprobs], prompt_token_ids=delta.prompt_token_ids,
                            index=delta.index,
                            prompt_logprobs=[_logprob(lp) for lp in delta.prompt_logprobs if lp.logprob is not None])


def _logprob(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, text=lp.text, top_logprobs=[
        common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob, text=t.text) for t in lp.top])


def finished_to_proto(finished: Finished) -> common_pb2.Finished:
    out = common_pb2.Finished(reason=_FINISH_REASONS[finished.reason], matched_stop=finished.matched_stop,
                              usage=usage_to_proto(finished.usage))
    if finished.matched_stop_token_id is not None:
        out.matched_stop_token_id = finished.matched_stop_token_id
    for end in finished.choices:
        choice = out.choices.add(index=end.index, reason=_FINISH_REASONS[end.reason], matched_stop=end.matched_stop,
                                 completion_tokens=end.completion_tokens)
        if end.matched_stop_token_id is not None:
            choice.matched_stop_token_id = end.matched_stop_token_id
    if finished.error is not None:
        out.error.CopyFrom(common_pb2.ErrorStatus(code=status_of(finished.error).value[0],
                                                  message=message_of(finished.error) or type(finished.error).__name__))
    return out


def usage_to_proto(usage: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens, ttft_ms=usage.ttft_ms, e2e_ms=usage.e2e_ms,
        kv_transfer_backend=_BACKEND_NUMBERS.get(usage.kv_transfer_backend, common_pb2.TRANSFER_BACKEND_UNSPECIFIED),
        kv_transfer_bytes=usage.kv_transfer_bytes, kv_transfer_ms=usage.kv_transfer_ms,
        ttft_breakdown=common_pb2.TtftBreakdown(**usage.ttft_breakdown.parts()))

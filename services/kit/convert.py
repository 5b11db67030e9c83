"""Proto ↔ engine types, in one place for every service."""
from __future__ import annotations

import json
import time

from common.engine.request import FinishReason, RequestType, SamplingParams, TokenLogprob
from common.engine.structured import CHOICE, JSON_OBJECT, StructuredOutput
from common.errors import InvalidRequest
from common.pb.disagg.v1 import common_pb2, worker_pb2

_FINISH_REASONS = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_CANCELLED,
}
_REQUEST_TYPES = {
    common_pb2.REQUEST_TYPE_CONTEXT_AND_GENERATION: RequestType.CONTEXT_AND_GENERATION,
    common_pb2.REQUEST_TYPE_CONTEXT_ONLY: RequestType.CONTEXT_ONLY,
    common_pb2.REQUEST_TYPE_GENERATION_ONLY: RequestType.GENERATION_ONLY,
}


def sampling_from_proto(
    sampling: common_pb2.SamplingParams,
    stop: common_pb2.StopConditions | None = None,
    output: common_pb2.OutputOptions | None = None,
) -> SamplingParams:
    """Unset fields take the engine's defaults; bad values raise InvalidRequest naming the field."""
    kwargs: dict = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "max_tokens",
                 "presence_penalty", "frequency_penalty", "n", "prompt_logprobs"):
        if sampling.HasField(name):
            kwargs[name] = getattr(sampling, name)
    if sampling.logit_bias:
        kwargs["logit_bias"] = dict(sampling.logit_bias)
    if stop is not None:
        kwargs["stop"] = tuple(stop.stop)
        kwargs["stop_token_ids"] = tuple(stop.stop_token_ids)
        if stop.HasField("ignore_eos"):
            kwargs["ignore_eos"] = stop.ignore_eos
    if output is not None:
        if output.top_logprobs < 0:
            raise InvalidRequest(f"top_logprobs must be >= 0, got {output.top_logprobs}")
        kwargs["logprobs"] = output.logprobs or output.top_logprobs > 0
        kwargs["top_logprobs"] = output.top_logprobs
    if sampling.HasField("structured"):
        kwargs["structured"] = structured_from_proto(sampling.structured)
    return SamplingParams(**kwargs)


def structured_from_proto(message: common_pb2.StructuredOutput) -> StructuredOutput | None:
    """None when no kind is set; InvalidRequest naming the field for a spec that does not hold."""
    kind = message.WhichOneof("kind")
    try:
        if kind is None:
            return None
        if kind == CHOICE:
            return StructuredOutput.choice(list(message.choice.options))
        if kind == JSON_OBJECT:
            if not message.json_object:
                raise InvalidRequest("json_object must be true when set")
            return StructuredOutput(JSON_OBJECT)
        return StructuredOutput(kind, getattr(message, kind))
    except InvalidRequest as exc:
        raise InvalidRequest(f"sampling.structured.{exc}") from None


def structured_to_proto(structured: StructuredOutput) -> common_pb2.StructuredOutput:
    if structured.kind == CHOICE:
        return common_pb2.StructuredOutput(choice=common_pb2.StructuredOutput.Choice(
            options=json.loads(structured.spec)))
    if structured.kind == JSON_OBJECT:
        return common_pb2.StructuredOutput(json_object=True)
    return common_pb2.StructuredOutput(**{structured.kind: structured.spec})


def sampling_to_proto(params: SamplingParams) -> tuple[common_pb2.SamplingParams, common_pb2.StopConditions,
                                                        common_pb2.OutputOptions]:
    """The inverse, for a service that forwards a request (router → prefill / decode)."""
    sampling = common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
    )
    if params.seed is not None:
        sampling.seed = params.seed
    if params.max_tokens is not None:
        sampling.max_tokens = params.max_tokens
    if params.presence_penalty:
        sampling.presence_penalty = params.presence_penalty
    if params.frequency_penalty:
        sampling.frequency_penalty = params.frequency_penalty
    if params.n != 1:
        sampling.n = params.n
    if params.prompt_logprobs is not None:
        sampling.prompt_logprobs = params.prompt_logprobs
    sampling.logit_bias.update(dict(params.logit_bias))
    if params.structured is not None:
        sampling.structured.CopyFrom(structured_to_proto(params.structured))
    stop = common_pb2.StopConditions(stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
                                     ignore_eos=params.ignore_eos)
    output = common_pb2.OutputOptions(logprobs=params.logprobs, top_logprobs=params.top_logprobs)
    return sampling, stop, output


def worker_stop_conditions(stop: common_pb2.StopConditions) -> common_pb2.StopConditions:
    """What a worker stops on: token ids and ignore_eos. Stop strings are matched by the router's text stream."""
    worker = common_pb2.StopConditions(stop_token_ids=stop.stop_token_ids)
    if stop.HasField("ignore_eos"):
        worker.ignore_eos = stop.ignore_eos
    return worker


def request_type_from_proto(value: int, default: RequestType) -> RequestType:
    if value == common_pb2.REQUEST_TYPE_UNSPECIFIED:
        return default
    if value not in _REQUEST_TYPES:
        raise InvalidRequest(f"unknown request_type {value}")
    return _REQUEST_TYPES[value]


def request_type_name(value: int) -> str:
    """The enum's name, or words for a number the proto does not define (for error messages)."""
    if value in common_pb2.RequestType.values():
        return common_pb2.RequestType.Name(value)
    return f"unknown request_type {value}"


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_REASONS.get(reason, common_pb2.FINISH_REASON_UNSPECIFIED)


def logprobs_to_proto(logprobs: list[TokenLogprob] | None) -> list[common_pb2.TokenLogprob]:
    return [logprob_to_proto(lp) for lp in logprobs or ()]


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


_KV_TIERS = {"device": worker_pb2.KV_TIER_DEVICE, "host": worker_pb2.KV_TIER_HOST, "disk": worker_pb2.KV_TIER_DISK}


def kv_tier_to_proto(tier: str = "device") -> int:
    """A common.kv.events tier name as a disagg.v1.KvTier."""
    return _KV_TIERS[tier]


def kv_event_to_proto(sequence: int, body: tuple, worker_id: str) -> worker_pb2.KvEvent:
    """One common.kv.events body as a disagg.v1.KvEvent."""
    event = worker_pb2.KvEvent(sequence=sequence, timestamp_unix_ms=int(time.time() * 1000), worker_id=worker_id)
    kind = body[0]
    if kind == "stored":
        _, hashes, parent, num_tokens, *tier = body
        event.stored.block_hashes.extend(hashes)
        event.stored.num_tokens = num_tokens
        event.stored.tier = kv_tier_to_proto(*tier)
        if parent is not None:
            event.stored.parent_hash = parent
    elif kind == "removed":
        event.removed.block_hashes.extend(body[1])
        event.removed.tier = kv_tier_to_proto(*body[2:])
    elif kind == "hit_cost":
        event.hit_cost.tier = kv_tier_to_proto(body[1])
        event.hit_cost.cost = body[2]
    else:
        event.cleared.SetInParent()
    return event

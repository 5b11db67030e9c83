"""A ModelInferRequest for the LLM model → the core's GenerationRequest, plus how to answer it.

Sampling values come from the `sampling_parameters` JSON object and from scalar inputs; a field given twice
(two inputs, or an input and a JSON key) is an error rather than a silent precedence. Numbers in the JSON may be
strings ("0.7"), as vLLM's Triton backend accepts them. Every error is InvalidRequest naming the input, key or
parameter.
"""
from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from common.engine.request import SamplingParams
from common.engine.structured import StructuredOutput
from common.errors import InvalidRequest
from common.pb.inference import grpc_service_pb2 as pb
from services.router.frontends.kserve_model import FLOATS, INPUTS, OUTPUTS, InputSpec, Reply
from services.router.frontends.kserve_tensors import Tensor, decode_inputs
from services.router.frontends.structured_fields import FIELDS as STRUCTURED_KEYS, structured_output
from services.router.generation import GenerationRequest

EMPTY_FINAL = "triton_enable_empty_final_response"
_SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


@dataclass(frozen=True)
class KserveRequest:
    generation: GenerationRequest
    reply: Reply
    stream: bool = False  # text deltas as they come, rather than one response with the whole text
    empty_final: bool = False  # end with a flags-only response marked triton_final_response


def parse_request(request: pb.ModelInferRequest, model_name: str) -> KserveRequest:
    """The request for the already-checked model `model_name`."""
    tensors = decode_inputs(request)
    for tensor in tensors.values():
        _check_tensor(tensor, model_name)
    missing = [s.name for s in INPUTS.values() if not s.optional and s.name not in tensors]
    if missing:
        raise InvalidRequest(f"input '{missing[0]}' is required (the prompt, BYTES, shape [1])")
    empty_final, timeout_ms = _parameters(request.parameters)
    generation = GenerationRequest(
        request_id=f"{request.id}-{uuid.uuid4().hex[:8]}" if request.id else uuid.uuid4().hex,
        prompt=_prompt(tensors["text_input"]), model=model_name, params=_sampling(tensors),
        timeout_ms=timeout_ms)
    reply = Reply(model_name, request.id, _outputs(request.outputs, model_name))
    return KserveRequest(generation, reply, _stream_flag(tensors), empty_final)


def _check_tensor(tensor: Tensor, model_name: str) -> None:
    spec = INPUTS.get(tensor.name)
    where = f"input '{tensor.name}'"
    if spec is None:
        raise InvalidRequest(f"{where} is not an input of model '{model_name}' (its inputs: {', '.join(INPUTS)})")
    if tensor.datatype not in spec.accepts:
        raise InvalidRequest(f"{where} has datatype {tensor.datatype}; it takes {spec.datatype}")
    one = len(tensor.shape) in (1, 2) and tensor.shape[:-1] in ((), (1,))  # [n] or [1, n]: one request
    if not one or (not spec.is_list and tensor.shape[-1] != 1):
        expected = "[n] or [1, n]" if spec.is_list else "[1] or [1, 1] (one request; no batching)"
        raise InvalidRequest(f"{where} has shape {list(tensor.shape)}; it takes {expected}")


def _prompt(tensor: Tensor) -> str:
    try:
        prompt = tensor.values[0].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"input 'text_input' is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not prompt:
        raise InvalidRequest("input 'text_input' is empty; it is the prompt")
    return prompt


def _stream_flag(tensors: dict[str, Tensor]) -> bool:
    given = [tensors[name] for name in ("stream", "streaming") if name in tensors]
    if len(given) > 1:
        raise InvalidRequest("inputs 'stream' and 'streaming' are the same flag; give one of them")
    return bool(given[0].values[0]) if given else False


def _parameters(parameters: Mapping[str, pb.InferParameter]) -> tuple[bool, int]:
    """(empty final response asked for, timeout in ms) from the request's parameters."""
    empty_final, timeout_ms = False, 0
    for key, value in parameters.items():
        kind = value.WhichOneof("parameter_choice")
        if key == EMPTY_FINAL:
            if kind != "bool_param":
                raise InvalidRequest(f"parameter '{key}' takes bool_param, got {kind}")
            empty_final = value.bool_param
        elif key == "timeout":  # tritonclient's `timeout`, in microseconds
            if kind != "int64_param" or value.int64_param < 0:
                raise InvalidRequest("parameter 'timeout' takes a non-negative int64_param (microseconds)")
            timeout_ms = math.ceil(value.int64_param / 1000)
        elif key in _SEQUENCE_PARAMETERS:
            raise InvalidRequest(f"parameter '{key}': sequence batching is not supported (requests are independent)")
        elif key != "priority":  # one queue: a priority changes nothing, so it is accepted
            raise InvalidRequest(f"parameter '{key}' is not supported (supported: {EMPTY_FINAL}, timeout, priority)")
    return empty_final, timeout_ms


def _outputs(requested: Sequence[pb.ModelInferRequest.InferRequestedOutputTensor],
             model_name: str) -> tuple[str, ...]:
    if not requested:
        return OUTPUTS
    for output in requested:
        if output.name not in OUTPUTS:
            raise InvalidRequest(f"requested output '{output.name}' is not an output of model '{model_name}' "
                                 f"(its outputs: {', '.join(OUTPUTS)})")
        if output.parameters:
            raise InvalidRequest(f"requested output '{output.name}': parameter '{next(iter(output.parameters))}' "
                                 "is not supported (no classification, no shared memory)")
    return tuple(output.name for output in requested)


def _sampling(tensors: dict[str, Tensor]) -> SamplingParams:
    """SamplingParams from the JSON object and the scalar inputs; each value checked where it came from."""
    fields: dict[str, object] = {}
    sources: dict[str, str] = {}
    given = [(f"input 'sampling_parameters' key '{key}'", key, value)
             for key, value in _json_fields(tensors.get("sampling_parameters")).items()]
    given += [(f"input '{t.name}'", INPUTS[t.name].field, _tensor_value(t, INPUTS[t.name]))
              for t in tensors.values() if INPUTS[t.name].field is not None]
    for source, field, value in given:
        if field in fields:
            raise InvalidRequest(f"{field} is given twice: by {sources[field]} and by {source}; give it once")
        try:
            SamplingParams(**{field: value})  # each field's own checks, so the error names its source
        except InvalidRequest as exc:
            raise InvalidRequest(f"{source}: {exc}") from None
        fields[field], sources[field] = value, source
    return SamplingParams(**fields)


def _tensor_value(tensor: Tensor, spec: InputSpec) -> object:
    if spec.datatype == "BYTES":
        return tuple(_utf8(f"input '{tensor.name}'", value) for value in tensor.values)
    if spec.is_list:
        return _token_ids(f"input '{tensor.name}'", tensor.values)
    value = tensor.values[0]
    return float(value) if spec.datatype in FLOATS else value


def _utf8(where: str, value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest(f"{where} has an element that is not valid UTF-8") from None


def _json_fields(tensor: Tensor | None) -> dict[str, object]:
    """The JSON object in `sampling_parameters`, each value converted to its SamplingParams type."""
    if tensor is None:
        return {}
    where = "input 'sampling_parameters'"
    try:
        document = json.loads(tensor.values[0])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidRequest(f"{where} must be a JSON object, got {type(document).__name__}")
    fields = {}
    structured = {key: document.pop(key) for key in STRUCTURED_KEYS if key in document}
    if structured:
        fields["structured"] = _structured(where, structured)
    for key, value in document.items():
        convert = _JSON_KEYS.get(key)
        if convert is None:
            raise InvalidRequest(f"{where} has unknown key '{key}' (known: {', '.join([*_JSON_KEYS, *STRUCTURED_KEYS])})")
        fields[key] = convert(f"{where} key '{key}'", value)
    return fields


def _structured(where: str, values: dict[str, object]) -> StructuredOutput | None:
    """response_format or a guided_* key, as the OpenAI door reads them (a JSON value or its JSON text)."""
    try:
        return structured_output(values)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{where} key {exc}") from None


def _as_float(where: str, value: object) -> float:
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
    raise InvalidRequest(f"{where} must be a number, got {json.dumps(value)}")


def _as_int(where: str, value: object) -> int:
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return int(value)
        except ValueError:
            pass
    raise InvalidRequest(f"{where} must be an integer, got {json.dumps(value)}")


def _as_bool(where: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):
        return value == "true"
    raise InvalidRequest(f"{where} must be true or false, got {json.dumps(value)}")


def _as_texts(where: str, value: object) -> tuple[str, ...]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
        raise InvalidRequest(f"{where} must be a string or a list of strings, got {json.dumps(value)}")
    return tuple(texts)


def _as_ints(where: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InvalidRequest(f"{where} must be a list of integers, got {json.dumps(value)}")
    return _token_ids(where, value)


def _as_bias(where: str, value: object) -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": bias}; its size is checked before it is read."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be an object of token id -> bias, got {json.dumps(value)}")
    if len(value) > SamplingParams.MAX_LOGIT_BIAS:
        raise InvalidRequest(f"{where}: logit_bias has {len(value)} entries; at most {SamplingParams.MAX_LOGIT_BIAS} "
                             "are accepted")
    return {_as_int(f"{where} token id", key): _as_float(f"{where} bias of {key}", bias) for key, bias in value.items()}


def _token_ids(where: str, values: Sequence[int]) -> tuple[int, ...]:
    if any(value < 0 for value in values):
        raise InvalidRequest(f"{where}: token ids must be >= 0, got {min(values)}")
    return tuple(int(value) for value in values)


_JSON_KEYS: dict[str, Callable[[str, object], object]] = {
    "max_tokens": _as_int, "temperature": _as_float, "top_p": _as_float, "top_k": _as_int, "min_p": _as_float,
    "repetition_penalty": _as_float, "seed": _as_int, "stop": _as_texts, "stop_token_ids": _as_ints,
    "ignore_eos": _as_bool, "presence_penalty": _as_float, "frequency_penalty": _as_float,
    "logit_bias": _as_bias,
}

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class RequestType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_TYPE_UNSPECIFIED: _ClassVar[RequestType]
    REQUEST_TYPE_CONTEXT_AND_GENERATION: _ClassVar[RequestType]
    REQUEST_TYPE_CONTEXT_ONLY: _ClassVar[RequestType]
    REQUEST_TYPE_GENERATION_ONLY: _ClassVar[RequestType]

class TransferBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_BACKEND_UNSPECIFIED: _ClassVar[TransferBackend]
    TRANSFER_BACKEND_GRPC: _ClassVar[TransferBackend]
    TRANSFER_BACKEND_SHM: _ClassVar[TransferBackend]
    TRANSFER_BACKEND_CUDA_IPC: _ClassVar[TransferBackend]
    TRANSFER_BACKEND_TRTLLM: _ClassVar[TransferBackend]
    TRANSFER_BACKEND_NIXL: _ClassVar[TransferBackend]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
REQUEST_TYPE_UNSPECIFIED: RequestType
REQUEST_TYPE_CONTEXT_AND_GENERATION: RequestType
REQUEST_TYPE_CONTEXT_ONLY: RequestType
REQUEST_TYPE_GENERATION_ONLY: RequestType
TRANSFER_BACKEND_UNSPECIFIED: TransferBackend
TRANSFER_BACKEND_GRPC: TransferBackend
TRANSFER_BACKEND_SHM: TransferBackend
TRANSFER_BACKEND_CUDA_IPC: TransferBackend
TRANSFER_BACKEND_TRTLLM: TransferBackend
TRANSFER_BACKEND_NIXL: TransferBackend

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "max_tokens", "presence_penalty", "frequency_penalty", "logit_bias", "n", "prompt_logprobs", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    max_tokens: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    n: int
    prompt_logprobs: int
    structured: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., max_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., n: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
    class Choice(_message.Message):
        __slots__ = ("options",)
        OPTIONS_FIELD_NUMBER: _ClassVar[int]
        options: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, options: _Optional[_Iterable[str]] = ...) -> None: ...
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: StructuredOutput.Choice
    grammar: str
    structural_tag: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StructuredOutput.Choice, _Mapping]] = ..., grammar: _Optional[str] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class StopConditions(_message.Message):
    __slots__ = ("stop", "stop_token_ids", "ignore_eos")
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class OutputOptions(_message.Message):
    __slots__ = ("logprobs", "top_logprobs", "echo_prompt_token_ids")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ECHO_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    logprobs: bool
    top_logprobs: int
    echo_prompt_token_ids: bool
    def __init__(self, logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., echo_prompt_token_ids: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "ttft_ms", "e2e_ms", "kv_transfer_backend", "kv_transfer_bytes", "kv_transfer_ms", "ttft_breakdown")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    ttft_ms: float
    e2e_ms: float
    kv_transfer_backend: TransferBackend
    kv_transfer_bytes: int
    kv_transfer_ms: float
    ttft_breakdown: TtftBreakdown
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., e2e_ms: _Optional[float] = ..., kv_transfer_backend: _Optional[_Union[TransferBackend, str]] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transfer_ms: _Optional[float] = ..., ttft_breakdown: _Optional[_Union[TtftBreakdown, _Mapping]] = ...) -> None: ...

class TtftBreakdown(_message.Message):
    __slots__ = ("router_queue_ms", "prefill_queue_ms", "prefill_compute_ms", "kv_handoff_ms", "first_decode_step_ms")
    ROUTER_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_DECODE_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    router_queue_ms: float
    prefill_queue_ms: float
    prefill_compute_ms: float
    kv_handoff_ms: float
    first_decode_step_ms: float
    def __init__(self, router_queue_ms: _Optional[float] = ..., prefill_queue_ms: _Optional[float] = ..., prefill_compute_ms: _Optional[float] = ..., kv_handoff_ms: _Optional[float] = ..., first_decode_step_ms: _Optional[float] = ...) -> None: ...

class ErrorStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "prompt_token_ids", "index", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ChoiceFinished(_message.Message):
    __slots__ = ("index", "reason", "matched_stop", "matched_stop_token_id", "completion_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    reason: FinishReason
    matched_stop: str
    matched_stop_token_id: int
    completion_tokens: int
    def __init__(self, index: _Optional[int] = ..., reason: _Optional[_Union[FinishReason, str]] = ..., matched_stop: _Optional[str] = ..., matched_stop_token_id: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "matched_stop", "usage", "error", "matched_stop_token_id", "choices")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    matched_stop: str
    usage: Usage
    error: ErrorStatus
    matched_stop_token_id: int
    choices: _containers.RepeatedCompositeFieldContainer[ChoiceFinished]
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., matched_stop: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[_Union[ErrorStatus, _Mapping]] = ..., matched_stop_token_id: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[ChoiceFinished, _Mapping]]] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("request_id", "reason", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    index: int
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "data_url", "path")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DATA_URL_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    data_url: str
    path: str
    def __init__(self, data: _Optional[bytes] = ..., data_url: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class KvSessionRef(_message.Message):
    __slots__ = ("session_id", "request_id", "endpoint", "transfer_backend", "num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "num_tokens", "block_ids", "fingerprint", "first_token", "first_token_logprob", "expires_at_unix_ms", "attributes")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    request_id: str
    endpoint: str
    transfer_backend: TransferBackend
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    fingerprint: str
    first_token: int
    first_token_logprob: float
    expires_at_unix_ms: int
    attributes: _containers.ScalarMap[str, str]
    def __init__(self, session_id: _Optional[str] = ..., request_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., transfer_backend: _Optional[_Union[TransferBackend, str]] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., fingerprint: _Optional[str] = ..., first_token: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., expires_at_unix_ms: _Optional[int] = ..., attributes: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EmbeddingRef(_message.Message):
    __slots__ = ("handle", "endpoint", "shape", "dtype", "content_hash", "placeholder_token_count", "expires_at_unix_ms")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    handle: str
    endpoint: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    content_hash: str
    placeholder_token_count: int
    expires_at_unix_ms: int
    def __init__(self, handle: _Optional[str] = ..., endpoint: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., content_hash: _Optional[str] = ..., placeholder_token_count: _Optional[int] = ..., expires_at_unix_ms: _Optional[int] = ...) -> None: ...

from common.pb.disagg.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_AGGREGATED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_ENCODE: _ClassVar[WorkerRole]

class TensorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_KIND_UNSPECIFIED: _ClassVar[TensorKind]
    TENSOR_KIND_KV_CACHE: _ClassVar[TensorKind]
    TENSOR_KIND_EMBEDDING: _ClassVar[TensorKind]

class KvTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KvTier]
    KV_TIER_DEVICE: _ClassVar[KvTier]
    KV_TIER_HOST: _ClassVar[KvTier]
    KV_TIER_DISK: _ClassVar[KvTier]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_AGGREGATED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_ENCODE: WorkerRole
TENSOR_KIND_UNSPECIFIED: TensorKind
TENSOR_KIND_KV_CACHE: TensorKind
TENSOR_KIND_EMBEDDING: TensorKind
KV_TIER_UNSPECIFIED: KvTier
KV_TIER_DEVICE: KvTier
KV_TIER_HOST: KvTier
KV_TIER_DISK: KvTier

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.Image]
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[_common_pb2.Image, _Mapping]]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("embeddings",)
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[_common_pb2.EmbeddingRef]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[_common_pb2.EmbeddingRef, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "embeddings", "output", "request_type")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TYPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    embeddings: _containers.RepeatedCompositeFieldContainer[_common_pb2.EmbeddingRef]
    output: _common_pb2.OutputOptions
    request_type: _common_pb2.RequestType
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., embeddings: _Optional[_Iterable[_Union[_common_pb2.EmbeddingRef, _Mapping]]] = ..., output: _Optional[_Union[_common_pb2.OutputOptions, _Mapping]] = ..., request_type: _Optional[_Union[_common_pb2.RequestType, str]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "first_token_logprob", "first_token_top_logprobs", "session", "cached_tokens", "ttft_breakdown", "more_first_tokens", "prompt_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    MORE_FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    first_token_logprob: float
    first_token_top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprob]
    session: _common_pb2.KvSessionRef
    cached_tokens: int
    ttft_breakdown: _common_pb2.TtftBreakdown
    more_first_tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, first_token: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., first_token_top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprob, _Mapping]]] = ..., session: _Optional[_Union[_common_pb2.KvSessionRef, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., ttft_breakdown: _Optional[_Union[_common_pb2.TtftBreakdown, _Mapping]] = ..., more_first_tokens: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class TaggedDecodeClientMessage(_message.Message):
    __slots__ = ("tag", "message", "timeout_s", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TAG_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    tag: int
    message: DecodeClientMessage
    timeout_s: float
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, tag: _Optional[int] = ..., message: _Optional[_Union[DecodeClientMessage, _Mapping]] = ..., timeout_s: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DecodeManyRequest(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[TaggedDecodeClientMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[TaggedDecodeClientMessage, _Mapping]]] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class TaggedDecodeServerMessage(_message.Message):
    __slots__ = ("tag", "message", "end")
    TAG_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    tag: int
    message: DecodeServerMessage
    end: RequestStatus
    def __init__(self, tag: _Optional[int] = ..., message: _Optional[_Union[DecodeServerMessage, _Mapping]] = ..., end: _Optional[_Union[RequestStatus, _Mapping]] = ...) -> None: ...

class DecodeManyResponse(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[TaggedDecodeServerMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[TaggedDecodeServerMessage, _Mapping]]] = ...) -> None: ...

class DecodeStart(_message.Message):
    __slots__ = ("request_id", "token_ids", "first_token", "session", "sampling", "stop", "output", "request_type", "embeddings", "choice_indices", "more_first_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TYPE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    MORE_FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    session: _common_pb2.KvSessionRef
    sampling: _common_pb2.SamplingParams
    stop: _common_pb2.StopConditions
    output: _common_pb2.OutputOptions
    request_type: _common_pb2.RequestType
    embeddings: _containers.RepeatedCompositeFieldContainer[_common_pb2.EmbeddingRef]
    choice_indices: _containers.RepeatedScalarFieldContainer[int]
    more_first_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., session: _Optional[_Union[_common_pb2.KvSessionRef, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Union[_common_pb2.StopConditions, _Mapping]] = ..., output: _Optional[_Union[_common_pb2.OutputOptions, _Mapping]] = ..., request_type: _Optional[_Union[_common_pb2.RequestType, str]] = ..., embeddings: _Optional[_Iterable[_Union[_common_pb2.EmbeddingRef, _Mapping]]] = ..., choice_indices: _Optional[_Iterable[int]] = ..., more_first_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeClientMessage(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: DecodeStart
    cancel: _common_pb2.Cancel
    def __init__(self, start: _Optional[_Union[DecodeStart, _Mapping]] = ..., cancel: _Optional[_Union[_common_pb2.Cancel, _Mapping]] = ...) -> None: ...

class DecodeServerMessage(_message.Message):
    __slots__ = ("request_id", "delta", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta: _common_pb2.Delta
    finished: _common_pb2.Finished
    def __init__(self, request_id: _Optional[str] = ..., delta: _Optional[_Union[_common_pb2.Delta, _Mapping]] = ..., finished: _Optional[_Union[_common_pb2.Finished, _Mapping]] = ...) -> None: ...

class OpenKvCacheRequest(_message.Message):
    __slots__ = ("transport",)
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    transport: str
    def __init__(self, transport: _Optional[str] = ...) -> None: ...

class KvCacheShare(_message.Message):
    __slots__ = ("kv_cache_id", "shape", "dtype", "transport", "attributes", "payload")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KV_CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    kv_cache_id: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    transport: str
    attributes: _containers.ScalarMap[str, str]
    payload: bytes
    def __init__(self, kv_cache_id: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., transport: _Optional[str] = ..., attributes: _Optional[_Mapping[str, str]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class CudaIpcShare(_message.Message):
    __slots__ = ("device_uuid", "ipc_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "stride", "tensor_offset", "head_shards")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    HEAD_SHARDS_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    ipc_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    stride: _containers.RepeatedScalarFieldContainer[int]
    tensor_offset: int
    head_shards: _containers.RepeatedCompositeFieldContainer[CudaIpcShare]
    def __init__(self, device_uuid: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., stride: _Optional[_Iterable[int]] = ..., tensor_offset: _Optional[int] = ..., head_shards: _Optional[_Iterable[_Union[CudaIpcShare, _Mapping]]] = ...) -> None: ...

class NixlShare(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "base_addr", "num_layers", "num_blocks", "region_bytes", "mem_type", "device_id")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    base_addr: int
    num_layers: int
    num_blocks: int
    region_bytes: int
    mem_type: str
    device_id: int
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., base_addr: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ..., region_bytes: _Optional[int] = ..., mem_type: _Optional[str] = ..., device_id: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("handle", "max_chunk_bytes", "block_ids", "shm_path")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    handle: str
    max_chunk_bytes: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    shm_path: str
    def __init__(self, handle: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., shm_path: _Optional[str] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("kind", "shape", "dtype", "layout", "block_ids", "fingerprint")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    kind: TensorKind
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    layout: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    fingerprint: str
    def __init__(self, kind: _Optional[_Union[TensorKind, str]] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., layout: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("offset", "total_bytes", "data", "header")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    offset: int
    total_bytes: int
    data: bytes
    header: TensorHeader
    def __init__(self, offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., header: _Optional[_Union[TensorHeader, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: str
    def __init__(self, handle: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released", "reason")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    released: bool
    reason: str
    def __init__(self, released: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLimits(_message.Message):
    __slots__ = ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests", "max_message_bytes", "max_top_logprobs", "session_ttl_ms")
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting_requests: int
    max_message_bytes: int
    max_top_logprobs: int
    session_ttl_ms: int
    def __init__(self, max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_waiting_requests: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_top_logprobs: _Optional[int] = ..., session_ttl_ms: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("role", "model", "fingerprint", "block_size", "num_layers", "num_kv_heads", "head_dim", "dtype", "max_model_len", "limits", "worker_id", "endpoint", "engine", "engine_version", "transfer_backends", "supports_images", "tensor_parallel_size", "engine_config_json")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_IMAGES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    model: str
    fingerprint: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_model_len: int
    limits: WorkerLimits
    worker_id: str
    endpoint: str
    engine: str
    engine_version: str
    transfer_backends: _containers.RepeatedScalarFieldContainer[_common_pb2.TransferBackend]
    supports_images: bool
    tensor_parallel_size: int
    engine_config_json: str
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., max_model_len: _Optional[int] = ..., limits: _Optional[_Union[WorkerLimits, _Mapping]] = ..., worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., engine: _Optional[str] = ..., engine_version: _Optional[str] = ..., transfer_backends: _Optional[_Iterable[_Union[_common_pb2.TransferBackend, str]]] = ..., supports_images: _Optional[bool] = ..., tensor_parallel_size: _Optional[int] = ..., engine_config_json: _Optional[str] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "kv_blocks_total", "kv_blocks_free", "kv_usage_ratio", "active_kv_sessions", "stored_tensors", "stored_tensor_bytes", "timestamp_unix_ms", "expired_kv_sessions", "prompt_tokens_to_compute", "preemptions")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_RATIO_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_KV_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STORED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    STORED_TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_KV_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TO_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_usage_ratio: float
    active_kv_sessions: int
    stored_tensors: int
    stored_tensor_bytes: int
    timestamp_unix_ms: int
    expired_kv_sessions: int
    prompt_tokens_to_compute: int
    preemptions: int
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_usage_ratio: _Optional[float] = ..., active_kv_sessions: _Optional[int] = ..., stored_tensors: _Optional[int] = ..., stored_tensor_bytes: _Optional[int] = ..., timestamp_unix_ms: _Optional[int] = ..., expired_kv_sessions: _Optional[int] = ..., prompt_tokens_to_compute: _Optional[int] = ..., preemptions: _Optional[int] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_hash", "num_tokens", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_hash: int
    num_tokens: int
    tier: KvTier
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_hash: _Optional[int] = ..., num_tokens: _Optional[int] = ..., tier: _Optional[_Union[KvTier, str]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: KvTier
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[KvTier, str]] = ...) -> None: ...

class AllCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierHitCost(_message.Message):
    __slots__ = ("tier", "cost")
    TIER_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    tier: KvTier
    cost: float
    def __init__(self, tier: _Optional[_Union[KvTier, str]] = ..., cost: _Optional[float] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("sequence", "timestamp_unix_ms", "worker_id", "stored", "removed", "cleared", "hit_cost")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    HIT_COST_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    timestamp_unix_ms: int
    worker_id: str
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllCleared
    hit_cost: TierHitCost
    def __init__(self, sequence: _Optional[int] = ..., timestamp_unix_ms: _Optional[int] = ..., worker_id: _Optional[str] = ..., stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllCleared, _Mapping]] = ..., hit_cost: _Optional[_Union[TierHitCost, _Mapping]] = ...) -> None: ...

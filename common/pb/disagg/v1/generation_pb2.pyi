from common.pb.disagg.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "token_ids", "chat", "images", "sampling", "stop", "output", "timeout_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    token_ids: TokenIds
    chat: Chat
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.Image]
    sampling: _common_pb2.SamplingParams
    stop: _common_pb2.StopConditions
    output: _common_pb2.OutputOptions
    timeout_ms: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., images: _Optional[_Iterable[_Union[_common_pb2.Image, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Union[_common_pb2.StopConditions, _Mapping]] = ..., output: _Optional[_Union[_common_pb2.OutputOptions, _Mapping]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: GenerateRequest
    cancel: _common_pb2.Cancel
    def __init__(self, start: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[_Union[_common_pb2.Cancel, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "delta", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta: _common_pb2.Delta
    finished: _common_pb2.Finished
    def __init__(self, request_id: _Optional[str] = ..., delta: _Optional[_Union[_common_pb2.Delta, _Mapping]] = ..., finished: _Optional[_Union[_common_pb2.Finished, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "max_model_len", "supports_images")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_IMAGES_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    supports_images: bool
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., supports_images: _Optional[bool] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

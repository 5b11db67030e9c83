"""The engine interface: the only way a worker service touches an engine.

Our PyTorch engine (AsyncLLMEngine over LLMEngine) implements it; TensorRT-LLM's LLM API is to sit
behind the same methods. Every method is called from the asyncio loop and runs on the engine's own
thread (or in its own runtime); results are plain values, never live engine state. The request types
are TensorRT-LLM's: context_only (prefill: the prompt's KV stays pinned under a session), generation_only
(decode: from imported KV and the first token) and context_and_generation (aggregated).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, Sequence

import torch

from common.engine.config import EngineConfig
from common.engine.multimodal import ImageEmbedding
from common.engine.request import RequestOutput, RequestType, SamplingParams
from common.kv.layout import KvExport, KvLayout
from common.kv.session import KvSession


@dataclass(frozen=True)
class EngineFacts:
    """What a worker announces (Worker/GetInfo) and checks against (KV layout), fixed once loaded."""

    kv_layout: KvLayout
    max_model_len: int
    config: EngineConfig
    image_token_id: int | None
    kv_device: torch.device
    name: str = "torch"


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot for Worker/GetLoad and the worker's gauges."""

    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_usage_ratio: float
    active_sessions: int
    expired_sessions: int
    session_bytes: int


class Engine(Protocol):
    async def facts(self) -> EngineFacts: ...

    async def load(self) -> EngineLoad: ...

    def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams | None = None,
                 request_type: RequestType = RequestType.CONTEXT_AND_GENERATION, kv_import: KvExport | None = None,
                 first_token: int | None = None,
                 images: list[ImageEmbedding] | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the stream early aborts it and frees its blocks."""

    async def abort(self, request_id: str) -> bool: ...

    async def abort_all(self) -> int: ...

    # --- KV sessions: the context_only → generation_only handoff ---

    async def session(self, session_id: str) -> KvSession:
        """A copy of a pinned session; NotFound / SessionExpired otherwise."""

    async def lease_session(self, session_id: str, block_ids: Sequence[int] = ()) -> list[int]:
        """Start an export: the blocks stay pinned (through a release or the TTL) until end_lease."""

    async def end_lease(self, session_id: str) -> None: ...

    async def release_session(self, session_id: str) -> bool:
        """Free a session's blocks; False when it was unknown, expired or already released."""

    async def release_sessions_of(self, request_id: str) -> int: ...

    async def release_all_sessions(self) -> int: ...

    async def kv_cache(self) -> torch.Tensor:
        """The whole paged cache [layers, 2, blocks, block_size, kv_heads, head_dim], for the KV data plane."""

    # --- KV events, for KV-aware routing ---

    async def subscribe_kv_events(self, loop: asyncio.AbstractEventLoop) -> Any | None:
        """A subscription (its `.queue` yields (sequence, event)), or None without a prefix cache."""

    def unsubscribe_kv_events(self, subscriber: Any) -> None: ...

    def shutdown(self) -> None: ...


def start_engine(config: EngineConfig) -> Engine:
    """Load the engine `config.engine` names (blocking: call it in a thread): our PyTorch engine, started on its
    own thread, or TensorRT-LLM (InvalidConfig where it is not installed)."""
    if config.engine == "trtllm":
        from common.engine.trtllm import TrtLlmEngine

        return TrtLlmEngine.from_config(config)
    from common.engine.async_engine import AsyncLLMEngine

    return AsyncLLMEngine.from_config(config)

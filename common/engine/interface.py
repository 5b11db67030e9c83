"""The engine interface: the only way a worker service touches an engine.

Our PyTorch engine (AsyncLLMEngine over LLMEngine) implements it; TensorRT-LLM's LLM API is to sit
behind the same methods. Every method is called from the asyncio loop and runs on the engine's own
thread (or in its own runtime); results are plain values, never live engine state. The request types
are TensorRT-LLM's: context_only (prefill: the prompt's KV stays pinned under a session), generation_only
(decode: from imported KV and the first token) and context_and_generation (aggregated).

How a context's KV reaches the generation side follows from what the engine can do (common.kv.paths picks it):
- a `KvSessionHost` (our engine) exposes its paged cache (`kv_blocks`) and pins a session's blocks
  (`lease_session` / `end_lease`); our KV data plane (TensorStore and the transports of common.kv.transport) serves
  them and the decode side pulls them (KvPuller) into its `kv_import`.
- an `OwnKvTransport` (TensorRT-LLM) moves KV itself, through the transport it names (`kv_transport`, registered in
  common.kv.transport: "trtllm", its cache transceiver): the context side's `session_attributes` go into the
  KvSessionRef (its DisaggregatedParams), and the generation side turns them back into its `kv_import` with
  `kv_import_from_attributes`.

Besides this module, a service may import the plain types it speaks in (request, config, multimodal,
stopping, default_model, structured) and one more seam, common.engine.image_encoder (the encode worker's engine:
images → embeddings); tests/integration/test_engine_interface.py walks the imports of every service module.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping, Protocol, Sequence, Union, runtime_checkable

import torch

from common.engine.config import EngineConfig
from common.engine.multimodal import ImageEmbedding
from common.engine.request import RequestOutput, RequestType, SamplingParams
from common.kv.blocks import KvBlocks
from common.kv.layout import KvExport, KvLayout, PlacedKv
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


class EngineKvImport(Protocol):
    """A context phase's state for an engine that moves KV itself (TensorRT-LLM: its DisaggregatedParams)."""

    def attributes(self) -> dict[str, str]:
        """As KvSessionRef.attributes."""


# EngineRequest.kv_import: KV pulled over our data plane (into a tensor, or straight into the engine's blocks), or an
# engine's own import state (EngineKvImport).
KvImport = Union[KvExport, PlacedKv, EngineKvImport]


@dataclass
class EngineRequest:
    """One request for `Engine.generate`. `request_type` is TensorRT-LLM's DisaggregatedParams.request_type:
    context_only (prefill: the prompt's KV stays pinned under a session), generation_only (decode: from
    `kv_import` and `first_token`, the context phase's first_gen_tokens; without kv_import the engine recomputes the
    prompt) or context_and_generation (aggregated)."""

    request_id: str  # unique in the engine
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_type: RequestType = RequestType.CONTEXT_AND_GENERATION
    kv_import: KvImport | None = None
    first_token: int | None = None
    images: list[ImageEmbedding] | None = None
    # n > 1 (sampling.n): the choice indices this engine runs, leader first (empty: 0..n-1), and for
    # generation_only the first token of each choice after the leader's (`first_token`).
    more_first_tokens: list[int] = field(default_factory=list)
    choices: list[int] = field(default_factory=list)


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
    prompt_tokens_to_compute: int | None = None
    """Prompt tokens queued or part-way that the engine's steps still have to compute (a handed-off request whose KV
    came with it has none): whether a worker is busy prefilling, which `waiting` does not say on a decode worker,
    whose waiting requests are mostly handoffs about to join the next step. None: the engine does not say."""
    preemptions: int = 0
    """Running requests preempted since the engine started (freed, recomputed later)."""


class Engine(Protocol):
    async def facts(self) -> EngineFacts: ...

    async def load(self) -> EngineLoad: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the stream early aborts it and frees its blocks."""

    async def abort(self, request_id: str) -> bool: ...

    async def abort_all(self) -> int: ...

    # --- KV sessions: the context_only → generation_only handoff ---

    async def session(self, session_id: str) -> KvSession:
        """A copy of a pinned session; NotFound / SessionExpired otherwise."""

    async def release_session(self, session_id: str) -> bool:
        """Free a session's blocks; False when it was unknown, expired or already released."""

    async def release_sessions_of(self, request_id: str) -> int: ...

    async def release_all_sessions(self) -> int: ...

    async def session_attributes(self, session_id: str) -> dict[str, str]:
        """Context side: what the generation side needs to import the session through the engine's own transport,
        as KvSessionRef.attributes (TensorRT-LLM: "trtllm.*", its DisaggregatedParams); {} for a KvSessionHost,
        whose KV data plane's exporter adds its own. NotFound / SessionExpired as `session`."""

    # --- KV events, for KV-aware routing ---

    async def subscribe_kv_events(self, loop: asyncio.AbstractEventLoop) -> Any | None:
        """A subscription (its `.queue` yields (sequence, event)), or None without a prefix cache."""

    def unsubscribe_kv_events(self, subscriber: Any) -> None: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class KvSessionHost(Protocol):
    """An engine whose sessions' KV our KV data plane moves (ours): it pins a session's blocks while an export reads
    them and exposes its paged cache."""

    async def lease_session(self, session_id: str, block_ids: Sequence[int] = ()) -> list[int]:
        """Start an export: the blocks stay pinned (through a release or the TTL) until end_lease. Like
        end_lease and release_session, it never waits for a model step."""

    async def end_lease(self, session_id: str) -> None: ...

    async def kv_cache(self) -> torch.Tensor:
        """The paged cache [layers, 2, blocks, block_size, kv_heads, head_dim], for TensorStore."""

    async def kv_blocks(self) -> KvBlocks:
        """The cache and its pool (KvBlocks)."""


@runtime_checkable
class OwnKvTransport(Protocol):
    """An engine that moves KV itself (TensorRT-LLM's cache transceiver): its generation side rebuilds a
    kv_import from the context side's session attributes."""

    kv_transport: str
    """The transport it drives, by its name in common.kv.transport's registry ("trtllm")."""

    def kv_import_from_attributes(self, attributes: Mapping[str, str]) -> KvImport:
        """Generation side: a KvSessionRef's attributes → generate()'s kv_import for generation_only, for an
        engine that moves KV itself (TensorRT-LLM: the context's DisaggregatedParams); InvalidRequest when they
        are malformed."""

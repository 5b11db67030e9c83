"""TensorStore servicer: serves the tensors a worker holds (KV sessions; embeddings later) to pullers.

What is stored comes from a TensorSource, so the encode worker can serve embeddings through
the same servicer by providing its own source.
"""
from __future__ import annotations

import asyncio
from typing import Protocol, Sequence

import grpc

from common.engine.async_engine import AsyncLLMEngine
from common.engine.engine import LLMEngine
from common.errors import InvalidRequest, NotFound
from common.kv import shm
from common.kv.chunks import chunk_size, chunk_tensor, tensor_to_bytes
from common.kv.transfer import HEADER_ROOM, kv_header
from common.pb.disagg.v1 import worker_pb2, worker_pb2_grpc
from common.telemetry.metrics import Metrics
from services.serving import abort_with


class TensorSource(Protocol):
    """The tensors behind TensorStore handles."""

    async def export(self, handle: str, block_ids: Sequence[int]) -> tuple[worker_pb2.TensorHeader, memoryview]:
        """Header and raw little-endian bytes of a handle's tensor; NotFound / InvalidRequest otherwise."""

    async def release(self, handle: str) -> bool:
        """Free a handle; False when it was unknown, expired or already released."""

    async def stored(self) -> tuple[int, int]:
        """(handles held, bytes held), for Worker.GetLoad."""


class KvSessionSource:
    """Exported KV sessions of the engine; every access runs on the engine thread."""

    def __init__(self, engine: AsyncLLMEngine):
        self.engine = engine

    async def export(self, handle: str, block_ids: Sequence[int]) -> tuple[worker_pb2.TensorHeader, memoryview]:
        layout, ids, blocks = await self.engine.call(lambda e: _export(e, handle, list(block_ids)))
        return kv_header(layout, ids, blocks), tensor_to_bytes(blocks)

    async def release(self, handle: str) -> bool:
        return await self.engine.call(lambda e: _release(e, handle))

    async def stored(self) -> tuple[int, int]:
        return await self.engine.call(_stored)


def _export(engine: LLMEngine, handle: str, wanted: list[int]):
    session = engine.sessions.get(handle)
    if not wanted:
        return engine.kv_layout, session.block_ids, engine.export_session(handle).blocks
    foreign = sorted(set(wanted) - set(session.block_ids))
    if foreign:
        raise InvalidRequest(f"block ids {foreign[:8]} are not in KV session {handle}")
    return engine.kv_layout, wanted, engine.runner.export_blocks(wanted)


def _release(engine: LLMEngine, handle: str) -> bool:
    try:
        engine.release_session(handle)
    except NotFound:
        return False
    return True


def _stored(engine: LLMEngine) -> tuple[int, int]:
    sessions = engine.sessions.sessions.values()
    return len(sessions), sum(len(s.block_ids) for s in sessions) * engine.kv_layout.block_bytes()


class TensorHolder(Protocol):
    """The worker state the servicer reads (services.worker_service.WorkerState)."""

    tensor_source: TensorSource | None  # None until the worker has loaded
    max_message_bytes: int
    metrics: Metrics | None


class TensorStoreServicer(worker_pb2_grpc.TensorStoreServicer):
    def __init__(self, holder: TensorHolder):
        self.holder = holder

    async def Pull(self, request: worker_pb2.PullRequest, context: grpc.aio.ServicerContext):
        source = await self._source(context)
        try:
            if not request.handle:
                raise InvalidRequest("PullRequest.handle is empty")
            header, data = await source.export(request.handle, request.block_ids)
            size = chunk_size(request.max_chunk_bytes, self.holder.max_message_bytes, HEADER_ROOM)
            if request.shm_path:  # same host: the bytes go through the caller's /dev/shm file
                await asyncio.to_thread(shm.write_into, request.shm_path, data)
        except Exception as exc:
            await abort_with(context, exc)
        if request.shm_path:
            yield worker_pb2.TensorChunk(offset=0, total_bytes=len(data), header=header)
        else:
            for chunk in chunk_tensor(header, data, size):
                yield chunk
        if self.holder.metrics is not None and header.kind == worker_pb2.TENSOR_KIND_KV_CACHE:
            self.holder.metrics.get("disagg_kv_sessions_pulled_total").inc()

    async def Release(self, request: worker_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.ReleaseResponse:
        source = await self._source(context)
        return worker_pb2.ReleaseResponse(released=await source.release(request.handle))

    async def _source(self, context: grpc.aio.ServicerContext) -> TensorSource:
        if self.holder.tensor_source is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading; it holds no tensors yet")
        return self.holder.tensor_source

"""TensorStore servicer: serves the tensors a worker holds (KV sessions; embeddings later) to pullers.

What is stored comes from a TensorSource, so the encode worker can serve embeddings through
the same servicer by providing its own source.
"""
from __future__ import annotations

import asyncio
from typing import Protocol, Sequence

import grpc

from common.engine.interface import Engine
from common.errors import InvalidRequest, NotFound
from common.kv import gather, shm
from common.kv.errors import BackendUnavailable
from common.kv.chunks import chunk_size, encoded_chunks, tensor_to_bytes
from common.kv.layout import KvLayout
from common.kv.probe import PROBE_HANDLE
from common.kv.transfer import HEADER_ROOM, kv_header
from common.kv.transport import KvPath
from common.pb.disagg.v1 import worker_pb2, worker_pb2_grpc
from common.telemetry.metrics import Metrics
from services.kit.serving import abort_with

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["TensorStore"].full_name


class TensorSource(Protocol):
    """The tensors behind TensorStore handles."""

    async def export(self, handle: str, block_ids: Sequence[int]) -> tuple[worker_pb2.TensorHeader, memoryview]:
        """Header and raw little-endian bytes of a handle's tensor; NotFound / InvalidRequest otherwise."""

    async def release(self, handle: str) -> bool:
        """Free a handle; False when it was unknown, expired or already released."""

    async def missing_reason(self, handle: str) -> str:
        """Why a handle is not held (unknown, expired, released), in words."""


class KvSessionSource:
    """Exported KV sessions of the engine. Pulled ones (our data plane) are only leased by the engine (its blocks
    stay pinned through a release or the TTL until the lease ends); the gather runs on a side stream into pinned
    host memory, off the engine thread, which keeps stepping other requests meanwhile. Where the engine moves its
    sessions' KV itself, they are only released here."""

    def __init__(self, engine: Engine, layout: KvLayout, kv_path: KvPath):
        self.engine = engine
        self.layout = layout
        self.kv_path = kv_path  # the exporter's cache and its shares, or why there are none

    async def export(self, handle: str, block_ids: Sequence[int]) -> tuple[worker_pb2.TensorHeader, memoryview]:
        exporter = self.kv_path.cache_exporter(handle)
        if handle == PROBE_HANDLE:  # an importer's self-check: blocks of zeros, no session, no engine
            blocks = exporter.probe_blocks(self.layout)
            ids = list(range(blocks.shape[2]))
            return kv_header(self.layout, ids, blocks), tensor_to_bytes(await gather.gather_to_host(blocks, ids))
        lease = asyncio.ensure_future(self.engine.lease_session(handle, block_ids))
        try:
            ids = await asyncio.shield(lease)
            blocks = await gather.gather_to_host(exporter.kv_cache, ids)
        finally:  # a pull cancelled at any point, even before the engine answered the lease, ends it
            await asyncio.shield(asyncio.ensure_future(self._end_lease_once_taken(lease, handle)))
        return kv_header(self.layout, ids, blocks), tensor_to_bytes(blocks)

    async def _end_lease_once_taken(self, lease: asyncio.Future, handle: str) -> None:
        try:
            await lease
        except Exception:
            return  # no lease was taken (unknown or expired session, foreign block ids)
        await self.engine.end_lease(handle)

    async def release(self, handle: str) -> bool:
        return await self.engine.release_session(handle)

    async def missing_reason(self, handle: str) -> str:
        try:
            await self.engine.session(handle)
        except NotFound as exc:  # SessionExpired too
            return str(exc)
        return ""

    def share(self, transport: str) -> worker_pb2.KvCacheShare:
        return self.kv_path.share(transport)


class TensorHolder(Protocol):
    """The worker state the servicer reads (services.worker.service.WorkerState)."""

    tensor_source: TensorSource | None  # None until the worker has loaded
    max_message_bytes: int
    metrics: Metrics | None


def _serialize(message: bytes | worker_pb2.TensorChunk) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_tensor_store(servicer: "TensorStoreServicer", server: grpc.aio.Server) -> None:
    """add_TensorStoreServicer_to_server, but Pull may yield chunks serialized already (encoded_chunks)."""
    handlers = {
        "Pull": grpc.unary_stream_rpc_method_handler(
            servicer.Pull, request_deserializer=worker_pb2.PullRequest.FromString, response_serializer=_serialize),
        "Release": grpc.unary_unary_rpc_method_handler(
            servicer.Release, request_deserializer=worker_pb2.ReleaseRequest.FromString,
            response_serializer=worker_pb2.ReleaseResponse.SerializeToString),
        "OpenKvCache": grpc.unary_unary_rpc_method_handler(
            servicer.OpenKvCache, request_deserializer=worker_pb2.OpenKvCacheRequest.FromString,
            response_serializer=worker_pb2.KvCacheShare.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


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
            for chunk in encoded_chunks(header, data, size):  # serialized already: one copy of the data
                yield chunk
        if self.holder.metrics is not None and header.kind == worker_pb2.TENSOR_KIND_KV_CACHE \
                and request.handle != PROBE_HANDLE:
            self.holder.metrics.get("disagg_kv_sessions_pulled_total").inc()

    async def Release(self, request: worker_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.ReleaseResponse:
        source = await self._source(context)
        if await source.release(request.handle):
            return worker_pb2.ReleaseResponse(released=True)
        return worker_pb2.ReleaseResponse(released=False, reason=await source.missing_reason(request.handle))

    async def OpenKvCache(self, request: worker_pb2.OpenKvCacheRequest,
                          context: grpc.aio.ServicerContext) -> worker_pb2.KvCacheShare:
        source = await self._source(context)
        try:
            if not isinstance(source, KvSessionSource):
                raise BackendUnavailable("this worker's TensorStore holds embeddings, not a KV cache")
            return await asyncio.to_thread(source.share, request.transport)
        except Exception as exc:
            await abort_with(context, exc)

    async def _source(self, context: grpc.aio.ServicerContext) -> TensorSource:
        if self.holder.tensor_source is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading; it holds no tensors yet")
        return self.holder.tensor_source

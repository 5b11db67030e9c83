"""TensorStore servicer: serves the tensors a worker holds (KV sessions, embeddings) to pullers.

What is stored comes from a TensorSource: an engine worker's KvPath (its exporter's role: common.kv.paths), or the
encode worker's embedding table.
"""
from __future__ import annotations

import asyncio
from typing import Protocol, Sequence

import grpc

from common.errors import InvalidRequest
from common.kv.errors import TransportUnavailable
from common.kv.paths import KvPath
from common.kv.probe import PROBE_HANDLE
from common.kv.store import answer_pull
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
            answer = await answer_pull(request, header, data, self.holder.max_message_bytes)
        except Exception as exc:
            await abort_with(context, exc)
        for chunk in answer:
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
            if not isinstance(source, KvPath):
                raise TransportUnavailable("this worker's TensorStore holds embeddings, not a KV cache")
            return await asyncio.to_thread(source.share, request.transport)
        except Exception as exc:
            await abort_with(context, exc)

    async def _source(self, context: grpc.aio.ServicerContext) -> TensorSource:
        if self.holder.tensor_source is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading; it holds no tensors yet")
        return self.holder.tensor_source

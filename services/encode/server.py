"""Encoder servicer: images → embeddings kept in this worker's TensorStore under handles with a TTL."""
from __future__ import annotations

import argparse
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import grpc

from common.engine.image_encoder import ImageEncoder
from common.errors import InvalidRequest, NotFound, ResourceExhausted, Unavailable
from common.kv.chunks import tensor_to_bytes
from common.kv.embeddings import EmbeddingTable, StoredEmbedding, embedding_header, embedding_ref
from common.media import MediaConfig, load_image
from common.pb.disagg.v1 import worker_pb2, worker_pb2_grpc
from services.kit.serving import abort_with, check_deliverable
from services.worker.tensor_store import TensorStoreServicer, add_tensor_store
from services.worker.service import WorkerState

SERVICE_NAMES = [worker_pb2.DESCRIPTOR.services_by_name[name].full_name for name in ("Encoder", "TensorStore")]


@dataclass(kw_only=True)
class EncodeState(WorkerState):
    """The worker state, plus the encode worker's own: its embedding table, media rules and vision model."""

    role: int = worker_pb2.WORKER_ROLE_ENCODE
    table: EmbeddingTable
    media: MediaConfig
    max_images_per_request: int
    encoder: ImageEncoder | None = None
    # One thread: the vision model runs one batch at a time, off the event loop.
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="encode"))

    def require_encoder(self) -> ImageEncoder:
        if self.stopped:
            raise Unavailable(self.stopped)
        if self.encoder is None:
            raise Unavailable("the encode worker is still loading its model")
        return self.encoder


class EmbeddingSource:
    """TensorSource over the embedding table."""

    def __init__(self, table: EmbeddingTable):
        self.table = table

    async def export(self, handle: str, block_ids: Sequence[int]) -> tuple[worker_pb2.TensorHeader, memoryview]:
        if block_ids:
            raise InvalidRequest("block_ids apply to KV sessions; an embedding is pulled whole")
        entry = self.table.get(handle)
        return embedding_header(entry.tensor), tensor_to_bytes(entry.tensor)

    async def release(self, handle: str) -> bool:
        return self.table.release(handle)

    async def missing_reason(self, handle: str) -> str:
        try:
            self.table.get(handle)
        except NotFound as exc:
            return str(exc)
        return ""


def add_servicers(server: grpc.aio.Server, state: EncodeState, args: argparse.Namespace) -> None:
    worker_pb2_grpc.add_EncoderServicer_to_server(EncoderServicer(state), server)
    add_tensor_store(TensorStoreServicer(state), server)


class EncoderServicer(worker_pb2_grpc.EncoderServicer):
    def __init__(self, state: EncodeState):
        self.state = state

    async def Encode(self, request: worker_pb2.EncodeRequest,
                     context: grpc.aio.ServicerContext) -> worker_pb2.EncodeResponse:
        started = time.perf_counter()
        with self.state.admission.counted():  # the drain waits for it
            entries: list[StoredEmbedding] = []
            try:
                self.state.admission.check()
                entries = await self._store(request)
                check_deliverable(context, "the embeddings")
            except Exception as exc:
                for entry in entries:  # the caller will never learn their handles
                    self.state.table.release(entry.handle)
                await abort_with(context, exc)
        if self.state.metrics is not None:
            self.state.metrics.get("disagg_encode_latency_seconds").observe(time.perf_counter() - started)
        return worker_pb2.EncodeResponse(embeddings=[embedding_ref(e, self.state.endpoint) for e in entries])

    async def _store(self, request: worker_pb2.EncodeRequest) -> list[StoredEmbedding]:
        """Encode the request's images and keep the embeddings (all of them, or none when they do not fit)."""
        encoder = self.state.require_encoder()
        self._check_count(len(request.images))
        loop = asyncio.get_running_loop()
        embeddings = await loop.run_in_executor(self.state.executor, _encode, encoder, request, self.state.media)
        entries = []
        try:
            for tensor, content_hash in embeddings:
                entries.append(self.state.table.put(tensor, content_hash))
        except ResourceExhausted:
            for entry in entries:
                self.state.table.release(entry.handle)
            raise
        return entries

    def _check_count(self, count: int) -> None:
        if count == 0:
            raise InvalidRequest("EncodeRequest has no images")
        if count > self.state.max_images_per_request:
            raise ResourceExhausted(f"the request has {count} images; this worker takes at most "
                                    f"{self.state.max_images_per_request} (--max-images-per-request)")


def _encode(encoder: ImageEncoder, request: worker_pb2.EncodeRequest, media: MediaConfig) -> list[tuple]:
    """Decode every image first (so a bad one fails the request before any model work), then encode them."""
    decoded = []
    for i, image in enumerate(request.images):
        kind = image.WhichOneof("source")
        try:
            decoded.append(load_image(kind, getattr(image, kind) if kind else b"", media))
        except InvalidRequest as exc:
            raise InvalidRequest(f"image {i}: {exc}") from None
    tensors = encoder.encode([d.image for d in decoded])
    return [(t, d.content_hash) for t, d in zip(tensors, decoded)]

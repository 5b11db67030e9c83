"""Image embeddings on the TensorStore data plane: the holder's table (handles with a TTL) and the puller.

The encode worker keeps each image's embedding under a handle until prefill pulls and releases
it, or its TTL ends; a byte cap bounds what unpulled embeddings may hold.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc
import torch

from common.engine.multimodal import ImageEmbedding
from common.errors import InvalidRequest, LayoutMismatch, ResourceExhausted, SessionExpired
from common.kv.chunks import ChunkAssembler, dtype_name
from common.kv.wire import release_quietly
from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

EMBEDDING_DIMS = "token,hidden"


@dataclass
class StoredEmbedding:
    handle: str
    tensor: torch.Tensor  # [tokens, hidden], on the CPU
    content_hash: str
    expires_at_unix: float

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class EmbeddingTable:
    """Handles → embeddings, with a TTL and a byte cap; safe to use from the event loop and the encoder thread."""

    def __init__(self, ttl_s: float, max_bytes: int):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._entries: dict[str, StoredEmbedding] = {}
        self._lock = threading.Lock()
        self.num_expired = 0

    def put(self, tensor: torch.Tensor, content_hash: str) -> StoredEmbedding:
        entry = StoredEmbedding(uuid.uuid4().hex, tensor.detach().cpu().contiguous(), content_hash,
                                time.time() + self.ttl_s)
        with self._lock:
            self._expire_locked()
            held = sum(e.num_bytes for e in self._entries.values())
            if held + entry.num_bytes > self.max_bytes:
                raise ResourceExhausted(f"the encode worker holds {held} bytes of unpulled embeddings; another "
                                        f"{entry.num_bytes} would pass its limit (--max-stored-bytes={self.max_bytes})")
            self._entries[entry.handle] = entry
        return entry

    def get(self, handle: str) -> StoredEmbedding:
        with self._lock:
            self._expire_locked()
            entry = self._entries.get(handle)
        if entry is None:
            raise SessionExpired(f"embedding handle {handle} is unknown, released or expired "
                                 f"(embeddings are kept {self.ttl_s:g} s)")
        return entry

    def release(self, handle: str) -> bool:
        with self._lock:
            return self._entries.pop(handle, None) is not None

    def clear(self) -> int:
        with self._lock:
            dropped, self._entries = len(self._entries), {}
        return dropped

    def expire(self) -> int:
        with self._lock:
            return self._expire_locked()

    def stored(self) -> tuple[int, int]:
        with self._lock:
            self._expire_locked()
            return len(self._entries), sum(e.num_bytes for e in self._entries.values())

    def _expire_locked(self) -> int:
        now = time.time()
        expired = [h for h, e in self._entries.items() if e.expires_at_unix <= now]
        for handle in expired:
            del self._entries[handle]
            log.info("embedding %s expired unpulled", handle)
        self.num_expired += len(expired)
        return len(expired)


def embedding_header(tensor: torch.Tensor) -> worker_pb2.TensorHeader:
    return worker_pb2.TensorHeader(kind=worker_pb2.TENSOR_KIND_EMBEDDING, shape=list(tensor.shape),
                                   dtype=dtype_name(tensor.dtype), layout=EMBEDDING_DIMS)


def embedding_ref(entry: StoredEmbedding, endpoint: str) -> common_pb2.EmbeddingRef:
    return common_pb2.EmbeddingRef(
        handle=entry.handle, endpoint=endpoint, shape=list(entry.tensor.shape), dtype=dtype_name(entry.tensor.dtype),
        content_hash=entry.content_hash, placeholder_token_count=entry.tensor.shape[0],
        expires_at_unix_ms=int(entry.expires_at_unix * 1000),
    )


def check_ref(ref: common_pb2.EmbeddingRef) -> None:
    if not ref.handle or not ref.endpoint:
        raise InvalidRequest("an EmbeddingRef needs a handle and an endpoint")
    if not ref.content_hash:
        raise InvalidRequest(f"EmbeddingRef {ref.handle} has no content_hash (the prefix cache keys images by it)")


async def pull_embedding(channel: grpc.aio.Channel, ref: common_pb2.EmbeddingRef,
                         timeout_s: float | None = None) -> ImageEmbedding:
    """Pull one embedding (does not release it) over a channel from common.kv.wire.ChannelCache;
    the header must describe what the ref says."""
    check_ref(ref)
    assembler = ChunkAssembler()
    stream = worker_pb2_grpc.TensorStoreStub(channel).Pull(worker_pb2.PullRequest(handle=ref.handle),
                                                            timeout=timeout_s)
    async for chunk in stream:
        assembler.add(chunk)
    header, tensor = assembler.finish()
    if header.kind != worker_pb2.TENSOR_KIND_EMBEDDING or header.layout != EMBEDDING_DIMS or tensor.dim() != 2:
        raise LayoutMismatch(f"handle {ref.handle} holds a {worker_pb2.TensorKind.Name(header.kind)} tensor "
                             f"{list(header.shape)} ({header.layout}), not a [token, hidden] embedding")
    if ref.shape and list(ref.shape) != list(header.shape):
        raise LayoutMismatch(f"embedding {ref.handle} has shape {list(header.shape)}, its ref says {list(ref.shape)}")
    return ImageEmbedding(tensor, ref.content_hash)


async def pull_and_release_embeddings(channel_of: Callable[[str], grpc.aio.Channel],
                                      refs: Sequence[common_pb2.EmbeddingRef],
                                      timeout_s: float | None = None) -> list[ImageEmbedding]:
    """Pull every ref, then release each one whatever happened (success, failure or cancellation)."""
    for ref in refs:
        check_ref(ref)
    try:
        return list(await asyncio.gather(*(pull_embedding(channel_of(r.endpoint), r, timeout_s) for r in refs)))
    finally:
        await asyncio.shield(asyncio.gather(*(release_quietly(channel_of(r.endpoint), r.handle) for r in refs)))

"""TensorStore.Pull put together from the two-sided transports' halves (common.kv.transports.shm and grpc_pull):
the answer a TensorStore gives (its servicer, for KV sessions and embeddings alike), and pull_kv for tools and tests.
"""
from __future__ import annotations

import logging
from typing import Iterable

import grpc

from common.kv import host
from common.kv.chunks import chunk_size
from common.kv.transports import grpc_pull, shm
from common.kv.wire import HEADER_ROOM, PulledKv
from common.pb.disagg.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)


async def answer_pull(request: worker_pb2.PullRequest, header: worker_pb2.TensorHeader, data: memoryview,
                      max_message_bytes: int) -> Iterable[bytes | worker_pb2.TensorChunk]:
    """TensorStore.Pull's answer: with `shm_path` (same host) through the importer's /dev/shm file, else in chunks.
    Raises (InvalidRequest, ShmUnavailable) before anything is sent."""
    size = chunk_size(request.max_chunk_bytes, max_message_bytes, HEADER_ROOM)  # no room for data: InvalidRequest
    if request.shm_path:
        return await shm.answer(request, header, data)
    return grpc_pull.answer(header, data, size)


async def pull_kv(target: grpc.aio.Channel | str, ref: common_pb2.KvSessionRef, *, max_chunk_bytes: int = 0,
                  timeout_s: float | None = None) -> PulledKv:
    """Pull a session's blocks (does not release it) the simplest way that works: through /dev/shm when the
    exporter is on this host and can write there, else as chunks. The transports call pull_shm or pull_chunks
    themselves; this is for tools and tests."""
    if host.same_host(ref.attributes):
        try:
            return await shm.pull_shm(target, ref, timeout_s=timeout_s)
        except shm.files.ShmUnavailable as exc:
            log.info("shm pull of KV session %s refused (%s); pulling over gRPC", ref.session_id, exc)
    return await grpc_pull.pull_chunks(target, ref, max_chunk_bytes=max_chunk_bytes, timeout_s=timeout_s)

"""`grpc`: TensorStore.Pull chunks. Any host, always works: the last resort of every negotiation. Both halves: the
exporter's answer (chunks serialized already: one copy of the data) and the importer's pull (pull_chunks)."""
from __future__ import annotations

import time
from typing import Callable, Iterator

import grpc
import torch

from common.kv.chunks import ChunkAssembler, encoded_chunks, parse_chunk
from common.kv.transport import Importer, KvTransport
from common.kv.transports.two_sided import probe_two_sided, pull_two_sided
from common.kv.wire import PulledKv, kv_from_pull, open_channel
from common.pb.disagg.v1 import common_pb2, worker_pb2


class GrpcTransport(KvTransport):
    name = "grpc"

    async def pull(self, puller: Importer, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef,
                   timeout_s: float | None) -> PulledKv:
        return await pull_two_sided(puller, channel, ref, self.name, pull_chunks, timeout_s)

    async def probe(self, puller: Importer, channel: grpc.aio.Channel, probe: common_pb2.KvSessionRef) -> int:
        return await probe_two_sided(puller, channel, probe, pull_chunks)


_PULL_METHOD = "/disagg.v1.TensorStore/Pull"


def _raw_pull(channel: grpc.aio.Channel, request: worker_pb2.PullRequest, timeout_s: float | None):
    """TensorStore.Pull answering serialized chunks, which parse_chunk splits without copying the data."""
    call = channel.unary_stream(_PULL_METHOD, request_serializer=worker_pb2.PullRequest.SerializeToString,
                                response_deserializer=None)
    return call(request, timeout=timeout_s)


async def pull_chunks(target: grpc.aio.Channel | str, ref: common_pb2.KvSessionRef, *, max_chunk_bytes: int = 0,
                      timeout_s: float | None = None,
                      allocate: Callable[[int], torch.Tensor] | None = None) -> PulledKv:
    """Pull a session's blocks as TensorStore.Pull chunks (does not release it). `target` is a channel that
    accepts messages of MAX_CHUNK_BYTES + HEADER_ROOM (see ChannelCache) or an endpoint; `allocate` gives the
    receive buffer. Raises grpc.aio.AioRpcError from the exporter (NOT_FOUND when expired), LayoutMismatch /
    InvalidRequest on a bad stream."""
    start = time.perf_counter()
    assembler = ChunkAssembler(allocate)
    async with open_channel(target) as channel:
        request = worker_pb2.PullRequest(handle=ref.session_id, max_chunk_bytes=max_chunk_bytes)
        async for raw in _raw_pull(channel, request, timeout_s):
            assembler.add(*parse_chunk(raw))
    header, blocks = assembler.finish()
    export = kv_from_pull(header, blocks, ref)
    return PulledKv(export, len(assembler.buffer), time.perf_counter() - start)


def answer(header: worker_pb2.TensorHeader, data: memoryview, chunk_bytes: int) -> Iterator[bytes]:
    """The exporter's half: the data in chunks of `chunk_bytes`, each serialized already."""
    return encoded_chunks(header, data, chunk_bytes)

"""`shm`: same host; the bytes of a TensorStore.Pull go through /dev/shm (files.py), not the stream. Both halves:
the importer's pull (pull_shm) and the exporter's answer (answer). Whether to try is decided by the host id the
exporter puts in the ref's attributes (common.kv.host); if the exporter cannot open the file after all (another
mount namespace), the pull falls back to the next transport."""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import grpc
import torch

from common.errors import InvalidRequest
from common.kv import host
from common.kv.chunks import tensor_from_bytes, torch_dtype
from common.kv.transport import Importer, KvTransport
from common.kv.transports.shm import files
from common.kv.transports.two_sided import probe_two_sided, pull_two_sided
from common.kv.wire import PulledKv, kv_from_pull, open_channel
from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc


class ShmTransport(KvTransport):
    name = "shm"

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None if host.host_id() else "no /dev/shm or host id here"

    def applies(self, ref: common_pb2.KvSessionRef) -> bool:
        return host.same_host(ref.attributes)

    async def pull(self, puller: Importer, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef,
                   timeout_s: float | None) -> PulledKv:
        return await pull_two_sided(puller, channel, ref, self.name, pull_shm, timeout_s)

    async def probe(self, puller: Importer, channel: grpc.aio.Channel, probe: common_pb2.KvSessionRef) -> int:
        return await probe_two_sided(puller, channel, probe, pull_shm)


async def pull_shm(target: grpc.aio.Channel | str, ref: common_pb2.KvSessionRef, *, timeout_s: float | None = None,
                   allocate: Callable[[int], torch.Tensor] | None = None) -> PulledKv:
    """Pull a session's blocks (does not release it): the exporter writes them into a /dev/shm file of ours and
    answers just the header. Raises as pull_chunks does, and ShmUnavailable when the exporter cannot write there."""
    start = time.perf_counter()
    try:
        with files.shm_file() as path:
            async with open_channel(target) as channel:
                request = worker_pb2.PullRequest(handle=ref.session_id, shm_path=str(path))
                chunks = [c async for c in worker_pb2_grpc.TensorStoreStub(channel).Pull(request, timeout=timeout_s)]
            if len(chunks) != 1 or not chunks[0].HasField("header") or chunks[0].data:
                raise InvalidRequest(f"an shm pull of session {ref.session_id} must answer one header-only chunk, "
                                     f"got {len(chunks)} chunks")
            header, total = chunks[0].header, chunks[0].total_bytes
            buffer = (allocate or (lambda n: torch.empty(n, dtype=torch.uint8)))(total)
            await asyncio.to_thread(files.read_into, path, buffer)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        raise files.ShmUnavailable(f"the exporter cannot write into this host's /dev/shm: {exc.details()}") from None
    blocks = buffer.view(torch_dtype(header.dtype)).reshape(tuple(header.shape)) if total else \
        tensor_from_bytes(bytearray(), header.shape, header.dtype)
    export = kv_from_pull(header, blocks, ref)
    return PulledKv(export, total, time.perf_counter() - start, "shm")


async def answer(request: worker_pb2.PullRequest, header: worker_pb2.TensorHeader,
                 data: memoryview) -> list[worker_pb2.TensorChunk]:
    """The exporter's half: the bytes written into the importer's file (`shm_path`), the header answered alone.
    ShmUnavailable when this process cannot open the file."""
    await asyncio.to_thread(files.write_into, request.shm_path, data)
    return [worker_pb2.TensorChunk(offset=0, total_bytes=len(data), header=header)]

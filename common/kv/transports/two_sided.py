"""Pulls through the exporter's TensorStore.Pull (grpc chunks, or its bytes written into our /dev/shm file):
the exporter reads its own blocks under a lease, so once they have arrived they are the session's, and its
Release goes out without being waited for."""
from __future__ import annotations

from typing import Awaitable, Callable

import grpc
import torch

from common.kv import gather
from common.kv.errors import TransportUnavailable
from common.kv.layout import KvExport
from common.kv.transport import Importer
from common.kv.wire import PulledKv
from common.pb.disagg.v1 import common_pb2

# grpc_pull.pull_chunks or shm.pull_shm: (channel, ref, timeout_s=, allocate=) → the session's blocks.
Pull = Callable[..., Awaitable[PulledKv]]


def _pinned(puller: Importer) -> Callable[[int], torch.Tensor]:
    return lambda n: gather.pinned_empty(n, puller.device)


async def pull_two_sided(puller: Importer, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef, name: str,
                         pull: Pull, timeout_s: float | None) -> PulledKv:
    try:
        pulled = await pull(channel, ref, timeout_s=timeout_s, allocate=_pinned(puller))
        blocks = await gather.to_device(pulled.export.blocks, puller.device)
    except TransportUnavailable:
        raise  # the session stays pinned for the next transport
    except BaseException:
        await puller.releases.now(ref)
        raise
    puller.releases.later(ref)
    export = KvExport(pulled.export.layout, pulled.export.num_tokens, blocks)
    return PulledKv(export, pulled.num_bytes, pulled.seconds, name)


async def probe_two_sided(puller: Importer, channel: grpc.aio.Channel, probe: common_pb2.KvSessionRef,
                          pull: Pull) -> int:
    pulled = await pull(channel, probe, timeout_s=30, allocate=_pinned(puller))
    await gather.to_device(pulled.export.blocks, puller.device)
    return pulled.num_bytes

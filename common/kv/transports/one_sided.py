"""What one-sided transports share: the exporter's cache opened through TensorStore.OpenKvCache, checked
against the session before any byte moves, and a read that counts only if it is proven the session's: by the
exporter's block epochs (common.kv.fence) once it has ended, where this process maps them (the Release then goes
out unawaited), else by the Release's answer that the session held its blocks throughout."""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import grpc
import torch

from common.errors import LayoutMismatch, NotFound
from common.kv.errors import TransportUnavailable
from common.kv.fence import BlockEpochs, fence_of
from common.kv.layout import KvExport, layout_of
from common.kv.offer import KV_CACHE_ID_ATTRIBUTE
from common.kv.transport import Importer
from common.kv.wire import PulledKv
from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc


async def open_share(channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef, name: str) -> worker_pb2.KvCacheShare:
    request = worker_pb2.OpenKvCacheRequest(transport=name)
    try:
        share = await worker_pb2_grpc.TensorStoreStub(channel).OpenKvCache(request, timeout=10.0)
    except grpc.aio.AioRpcError as exc:
        if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
            raise TransportUnavailable(f"the exporter refused to share its cache: {exc.details()}") from None
        raise
    check_share(share, ref)
    return share


async def read_one_sided(puller: Importer, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef, name: str,
                         read: Callable[[grpc.aio.Channel, common_pb2.KvSessionRef], Awaitable[torch.Tensor]],
                         timeout_s: float | None, epochs: BlockEpochs | None = None) -> PulledKv:
    """The session's blocks read by `read`; `epochs`: the exporter's table, where this process maps it."""
    start = time.perf_counter()
    expected = fence_of(ref) if epochs is not None else None
    try:
        blocks = await asyncio.wait_for(read(channel, ref), timeout_s)
        read_s = time.perf_counter() - start
        if expected is not None:
            epochs.check(list(ref.block_ids), expected, f"KV session {ref.session_id} at {ref.endpoint}")
    except TransportUnavailable:
        raise
    except BaseException:
        await puller.releases.now(ref)
        raise
    if expected is not None:
        puller.releases.later(ref)  # proven already: the Release only frees the exporter's blocks
    else:
        await puller.releases.confirm(ref, name)
    export = KvExport(layout_of(ref), ref.num_tokens, blocks)
    export.validate()
    return PulledKv(export, blocks.numel() * blocks.element_size(), time.perf_counter() - start, name, read_s)


def check_share(share: worker_pb2.KvCacheShare, ref: common_pb2.KvSessionRef) -> None:
    """Refuse a cache whose layout is not the session's, before any byte moves."""
    layout = layout_of(ref)
    want = list(layout.block_shape(0))
    got = list(share.shape)
    if len(got) != 6 or got[:2] + got[3:] != want[:2] + want[3:] or share.dtype != ref.dtype:
        raise LayoutMismatch(f"the exporter's shared KV cache {got} {share.dtype} does not hold the session's layout "
                             f"{want[:2]}+[blocks]+{want[3:]} {ref.dtype}")
    if share.kv_cache_id != ref.attributes.get(KV_CACHE_ID_ATTRIBUTE, share.kv_cache_id):
        raise NotFound(f"KV session {ref.session_id} belongs to cache {ref.attributes[KV_CACHE_ID_ATTRIBUTE]}, but "
                       f"{ref.endpoint} now holds cache {share.kv_cache_id} (the worker restarted)")


def check_block_ids(ref: common_pb2.KvSessionRef, num_blocks: int) -> None:
    if ref.block_ids and max(ref.block_ids) >= num_blocks:
        bad = [b for b in ref.block_ids if b >= num_blocks]
        raise LayoutMismatch(f"KV session {ref.session_id} names blocks {bad[:8]} outside the exporter's "
                             f"{num_blocks} blocks")

"""A one-sided import straight into the importer's own blocks: reserve, copy, fence.

The importer reserves blocks from its engine's pool (KvBlocks.reserve: no engine step is waited for),
enqueues one copy of every layer's blocks from the exporter's cache (mapped through CUDA IPC) into them
on the data plane's side stream (block_copy.py: one kernel, no staging buffer), and, once the copy
has finished, checks the exporter's epoch table (common.kv.fence): the blocks are the session's only if
none was reused meanwhile. The session's Release is the caller's to send once the copy has finished
(`copied`), without waiting for its answer: it never sits on the critical path, and its own work on the
event loop does not delay noticing the copy's end. The result is a PlacedKv the engine adopts as it is.

On a CPU cache (tests) the same steps run synchronously through the torch reference copy.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import torch

from common.kv import gather
from common.kv.blocks import KvBlocks
from common.kv.fence import EPOCH_ATTRIBUTE, BlockEpochs, fence_of
from common.kv.layout import KvLayout, PlacedKv
from common.kv.shards import KvShards
from common.kv.transports.cuda_ipc import head_copy, peer_copy
from common.kv.transports.cuda_ipc.block_copy import BlockCopier
from common.pb.disagg.v1 import common_pb2


def can_place(source: torch.Tensor | KvShards, blocks: KvBlocks | None) -> bool:
    """Whether a copy can go straight from `source` into the engine's blocks: the same block layout, on one GPU or
    GPUs of the host with peer access between them (either side may be a tensor-parallel engine's shards, each
    rank's heads on its own GPU: head_copy.py)."""
    if blocks is None:
        return False
    cache = blocks.cache
    if isinstance(source, KvShards) or isinstance(cache, KvShards):
        devices = [*_devices(source), *_devices(cache)]
        return (head_copy.same_blocks(source, cache) and all(d.type == "cuda" for d in devices)
                and all(peer_copy.can_reach(a, b) for a in devices for b in devices))
    return (peer_copy.can_reach(cache.device, source.device) and source.dtype == cache.dtype
            and source.shape[:2] == cache.shape[:2] and source.shape[3:] == cache.shape[3:])


def _devices(cache: torch.Tensor | KvShards) -> list[torch.device]:
    return cache.devices() if isinstance(cache, KvShards) else [cache.device]


def blocks_for(ref: common_pb2.KvSessionRef) -> int:
    """The blocks an import of `ref` reserves: room for the first generated token too, so that the engine admits
    the request without allocating."""
    return -(-(ref.num_tokens + 1) // ref.block_size)


async def reserve_with_room(blocks: KvBlocks, ref: common_pb2.KvSessionRef, wait_s: float) -> list[int] | None:
    """The blocks of `ref`'s import, reserved as soon as the pool spares them beside its running requests' growth
    (BlockManager.reserve), checking every 1 ms, then 2, 4, ... 16 ms, while the pull waits: the session's KV stays
    with its exporter meanwhile, as a queued request waits in the engine. None after `wait_s`."""
    deadline, pause = time.monotonic() + wait_s, 0.001
    while (reserved := blocks.reserve(blocks_for(ref))) is None:
        if time.monotonic() + pause > deadline:
            return None
        await asyncio.sleep(pause)
        pause = min(2 * pause, 0.016)
    return reserved


async def import_placed(copier: BlockCopier, epochs: BlockEpochs, ref: common_pb2.KvSessionRef,
                        layout: KvLayout, blocks: KvBlocks, copied: Callable[[], None],
                        timeout_s: float | None = None, reserved: list[int] | None = None) -> PlacedKv | None:
    """The session's KV copied by `copier` from the exporter's whole cache into reserved blocks of ours (its
    destination: blocks.cache; `reserved`: blocks_for(ref) of them, reserved already, or None to reserve them
    now), fenced; None when the pool cannot spare the blocks now (the caller pulls another way). StaleKv when the
    exporter reused a block before the copy ended, asyncio.TimeoutError when the copy outlasts `timeout_s`: the
    reserved blocks are back in the pool then."""
    expected = fence_of(ref)
    if expected is None:
        if reserved is not None:
            blocks.free(reserved)
        raise ValueError(f"KV session {ref.session_id} carries no {EPOCH_ATTRIBUTE}")
    if reserved is None:
        reserved = blocks.reserve(blocks_for(ref))
    if reserved is None:
        return None
    src_ids, dst_ids = list(ref.block_ids), reserved[: len(ref.block_ids)]
    event = None
    try:
        if copier.device.type == "cuda":
            stream = gather.side_stream(copier.device)
            reading = copier(src_ids, dst_ids, stream)  # read by the copy until it has finished
            event = gather.recorded_event(stream)
            await gather.wait_event(event, timeout_s)
            gather.recycle_event(event)
            event = reading = None
        else:
            copier(src_ids, dst_ids)
        copied()
        epochs.check(src_ids, expected, f"KV session {ref.session_id} at {ref.endpoint}")
    except BaseException:
        if event is not None:
            event.synchronize()  # the copy may still write them: at most a copy's time (microseconds)
        blocks.free(reserved)
        raise
    return PlacedKv(layout, ref.num_tokens, reserved, blocks.free)

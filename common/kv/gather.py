"""KV block gathers and uploads that never run on the engine thread.

On a GPU every copy is enqueued on a side stream of its device (one per device, per process) and
awaited through a CUDA event from a worker thread, so neither the engine loop nor the gRPC event
loop waits for bytes to move. A session's blocks need no ordering against the engine's compute
stream: the session exists only after its first token was read back on the host, which ordered
every KV write of its prompt before it; its blocks are leased (LLMEngine.lease_session) so nothing
overwrites them while a gather reads.
"""
from __future__ import annotations

import asyncio
import threading
import time
from contextlib import ExitStack
from typing import Callable, Sequence

import torch

from common.kv.blocks import gather_blocks
from common.kv.buffers import host_empty
from common.kv.shards import KvShards

_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The data plane's own stream on `device` (created once), of the highest priority: a KV copy is on a
    request's critical path, so the GPU starts its blocks ahead of the model steps' queued ones."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        if index not in _streams:
            _streams[index] = torch.cuda.Stream(device=index, priority=-100)  # clamped to the highest
        return _streams[index]


_idle_events: dict[int, list[torch.cuda.Event]] = {}  # device index → finished events of recorded_event


def recorded_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event recorded on `stream` now, taken from the finished ones given back (recycle_event) where there is
    one: creating a CUDA event costs the host more than recording it, on a KV copy's critical path."""
    try:
        event = _idle_events[stream.device_index].pop()
    except (KeyError, IndexError):
        event = torch.cuda.Event()
    event.record(stream)
    return event


def recycle_event(event: torch.cuda.Event) -> None:
    """Give back an event of recorded_event that has completed and that nothing waits for any more."""
    _idle_events.setdefault(event.device.index, []).append(event)


async def wait_event(event: torch.cuda.Event, timeout_s: float | None = None, busy_s: float = 0.002,
                     spin_s: float = 0.01) -> None:
    """Await a CUDA event without blocking the loop (asyncio.TimeoutError after `timeout_s`). A KV copy takes
    well under a millisecond, and any timed sleep of the loop lasts at least one (epoll counts whole
    milliseconds), so it first polls between the loop's other work (sleep(0)) for `busy_s`, then every
    millisecond, then waits in a worker thread. The timeout is its own, so a caller needs no wait_for (a task
    of its own, and two more turns of the loop on the critical path)."""
    start = time.perf_counter()
    while not event.query():
        waited = time.perf_counter() - start
        if waited > spin_s:
            left = None if timeout_s is None else max(timeout_s - waited, 0.0)
            await asyncio.wait_for(asyncio.to_thread(event.synchronize), left)
            return
        if timeout_s is not None and waited > timeout_s:
            raise asyncio.TimeoutError(f"a KV copy did not finish within {timeout_s:g}s")
        await asyncio.sleep(0 if waited < busy_s else 1e-3)


def _on_side_stream(device: torch.device, work: Callable[[], torch.Tensor],
                    also: Sequence[torch.device] = ()) -> tuple[torch.Tensor, torch.cuda.Event]:
    """Enqueue `work` on the device's side stream (what it allocates is freed in that stream's order)
    and record an event after it; returns at once. `also`: other GPUs the work copies between (a sharded
    cache's), whose side streams it runs on too, so a peer copy waits for no compute stream."""
    stream = side_stream(device)
    with ExitStack() as streams:
        for other in also:
            if other != device:
                streams.enter_context(torch.cuda.stream(side_stream(other)))
        streams.enter_context(torch.cuda.device(device))
        streams.enter_context(torch.cuda.stream(stream))
        out = work()
        event = torch.cuda.Event()
        event.record(stream)
    return out, event


def _to_pinned(on_device: torch.Tensor) -> torch.Tensor:
    host = torch.empty(on_device.shape, dtype=on_device.dtype, pin_memory=True)
    return host.copy_(on_device, non_blocking=True)


def _devices(source: torch.Tensor | KvShards) -> list[torch.device]:
    return source.devices() if isinstance(source, KvShards) else [source.device]


async def gather_to_host(kv_cache: torch.Tensor | KvShards, block_ids: Sequence[int]) -> torch.Tensor:
    """kv_cache[:, :, block_ids] as a contiguous host tensor (pinned when the cache is on a GPU)."""
    if kv_cache.device.type != "cuda":  # into huge pages: the chunks are cut from it, it is written once
        return await asyncio.to_thread(gather_blocks, kv_cache, block_ids, host_empty)
    host, event = await asyncio.to_thread(_on_side_stream, kv_cache.device,
                                          lambda: _to_pinned(gather_blocks(kv_cache, block_ids)), _devices(kv_cache))
    await wait_event(event)
    return host


async def gather_on_device(source: torch.Tensor | KvShards, block_ids: Sequence[int],
                           device: torch.device) -> torch.Tensor:
    """source[:, :, block_ids] gathered GPU-side (source may be another process's cache mapped through
    CUDA IPC, or a tensor-parallel one's shards) into a new tensor on `device` (another GPU of this host: one
    peer copy); no host copy."""
    gathered, event = _on_side_stream(  # launches only: microseconds, so on the loop
        source.device, lambda: gather_blocks(source, block_ids).to(device, non_blocking=True),
        [*_devices(source), device])
    await wait_event(event)
    return gathered


async def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Upload pulled blocks on the side stream, so the engine's import is a device-side scatter only."""
    if device.type != "cuda" or host.device == device:
        return host
    on_device, event = await asyncio.to_thread(_on_side_stream, device,
                                               lambda: host.to(device, non_blocking=True))
    await wait_event(event)
    return on_device


def pinned_empty(num_bytes: int, device: torch.device) -> torch.Tensor:
    """A byte buffer to receive pulled KV into: pinned when it will go on to a GPU (the caching host allocator's,
    reused warm), else in huge pages (common.kv.buffers)."""
    if device.type == "cuda":
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    return host_empty(num_bytes)

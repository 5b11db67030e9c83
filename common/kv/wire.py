"""What the KV data plane's transports share over gRPC: session refs, TensorStore.Pull's header and its check,
channels to exporters, Release.

The exporter (prefill) describes a pinned session as a KvSessionRef; the importer (decode) pulls the blocks through
a transport (common.kv.transports), checks the header against the ref, and releases the session. The importer owns
the session once it has the ref, and sends every Release it owes through its Releases.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, NamedTuple, Sequence

import grpc
import torch

from common import channels
from common.errors import LayoutMismatch, NotFound, Unavailable
from common.kv import host
from common.kv.chunks import MAX_CHUNK_BYTES, dtype_name
from common.kv.fence import EPOCH_ATTRIBUTE
from common.kv.layout import KvExport, KvLayout, PlacedKv, layout_of
from common.kv.session import KvSession
from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

KV_DIMS = "layer,kv,block,slot,kv_head,head_dim"
# Room for a chunk's framing and the first chunk's header (block ids) on top of its data.
HEADER_ROOM = 1024 * 1024
RELEASE_TIMEOUT_S = 5.0
# The importer's socket reads start at 4 MiB and may grow to 16 MiB (gRPC's defaults: 8 KiB, up to 4 MiB): a pull's
# chunks then arrive in fewer, larger reads, which cost the importer's gRPC less CPU per byte.
_PULL_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_CHUNK_BYTES + HEADER_ROOM),
                         ("grpc.experimental.tcp_read_chunk_size", 4 * 1024 * 1024),
                         ("grpc.experimental.tcp_max_read_chunk_size", 16 * 1024 * 1024)]


class PulledKv(NamedTuple):
    export: KvExport | PlacedKv  # PlacedKv: already in the importing engine's blocks (a cuda_ipc import)
    num_bytes: int
    seconds: float
    transport: str = "grpc"  # how the bytes came: its transport's name
    read_seconds: float = 0.0  # one-sided transports: the read alone, before the release that confirms it
    transfer_backend: int = common_pb2.TRANSFER_BACKEND_UNSPECIFIED  # `transport`'s number, for Usage (the puller's)


def kv_header(layout: KvLayout, block_ids: Sequence[int], blocks: torch.Tensor) -> worker_pb2.TensorHeader:
    return worker_pb2.TensorHeader(
        kind=worker_pb2.TENSOR_KIND_KV_CACHE, shape=list(blocks.shape), dtype=dtype_name(blocks.dtype),
        layout=KV_DIMS, block_ids=list(block_ids), fingerprint=layout.fingerprint,
    )


def session_ref(layout: KvLayout, session: KvSession, endpoint: str,
                transfer_backend: int = common_pb2.TRANSFER_BACKEND_GRPC,
                attributes: dict[str, str] | None = None) -> common_pb2.KvSessionRef:
    """The handoff metadata of a pinned session, served by the TensorStore at `endpoint`; `attributes`
    carry the exporter's offer of transports (common.kv.sharing.KvCacheExporter.attributes)."""
    if attributes is None:  # an importer on this host may pull through shm
        attributes = {host.HOST_ID_ATTRIBUTE: host.host_id()}
    if session.epoch is not None:  # the fence of one-sided reads (common.kv.fence)
        attributes = {**attributes, EPOCH_ATTRIBUTE: str(session.epoch)}
    return common_pb2.KvSessionRef(
        session_id=session.session_id, request_id=session.request_id, endpoint=endpoint,
        transfer_backend=transfer_backend, num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, block_size=layout.block_size,
        dtype=layout.dtype, num_tokens=session.num_tokens, block_ids=session.block_ids,
        fingerprint=layout.fingerprint, first_token=session.first_token,
        expires_at_unix_ms=int(session.expires_at_unix * 1000), attributes=attributes,
    )


def kv_from_pull(header: worker_pb2.TensorHeader, blocks: torch.Tensor, ref: common_pb2.KvSessionRef) -> KvExport:
    """The pulled tensor as a KvExport, after checking that the header describes the session in `ref`."""
    layout = layout_of(ref)
    expected = {
        "kind": (worker_pb2.TensorKind.Name(header.kind), "TENSOR_KIND_KV_CACHE"),
        "layout": (header.layout, KV_DIMS),
        "fingerprint": (header.fingerprint, ref.fingerprint),
        "dtype": (header.dtype, ref.dtype),
        "shape": (list(header.shape), list(layout.block_shape(len(ref.block_ids)))),
        "block_ids": (list(header.block_ids), list(ref.block_ids)),
    }
    diffs = [f"{name}: pulled={got!r} ref={want!r}" for name, (got, want) in expected.items() if got != want]
    if diffs:
        raise LayoutMismatch(f"pulled KV of session {ref.session_id} does not match its ref (" + "; ".join(diffs) + ")")
    export = KvExport(layout, ref.num_tokens, blocks)
    export.validate()
    return export


@contextlib.asynccontextmanager
async def open_channel(target: grpc.aio.Channel | str) -> AsyncIterator[grpc.aio.Channel]:
    """`target` itself, or a channel to that endpoint for the block (one that takes TensorStore.Pull's chunks)."""
    if not isinstance(target, str):
        yield target
        return
    channel = channels.aio_channel(target, options=_PULL_CHANNEL_OPTIONS)
    try:
        yield channel
    finally:
        await channel.close()


async def release_session(target: grpc.aio.Channel | str, handle: str,
                          timeout_s: float | None = RELEASE_TIMEOUT_S) -> worker_pb2.ReleaseResponse:
    """Release a TensorStore handle; `released` is false (with the `reason`) when it was unknown,
    expired or already released."""
    async with open_channel(target) as channel:
        stub = worker_pb2_grpc.TensorStoreStub(channel)
        return await stub.Release(worker_pb2.ReleaseRequest(handle=handle), timeout=timeout_s)


async def release_quietly(target: grpc.aio.Channel | str, handle: str) -> bool:
    """Release, logging instead of raising: the exporter's TTL frees what a lost release leaves."""
    try:
        return (await release_session(target, handle)).released
    except grpc.aio.AioRpcError as exc:
        log.warning("could not release KV session %s (%s: %s); it will expire", handle, exc.code().name,
                    exc.details())
        return False


class Releases:
    """Every Release an importer sends its exporters, from one place: a pulled session's, off the critical path or
    confirming an unfenced read; a failed pull's, or one's that ended before its transport had the session (`owing`);
    a session it will not import (refused, or moved by its engine). Those sent off the critical path are awaited at
    `close`."""

    def __init__(self, channels: "ChannelCache"):
        self.channels = channels
        self._pending: set[asyncio.Task] = set()
        self._owed: set[str] = set()  # sessions whose Release is owed by an `owing` block still running

    @contextlib.asynccontextmanager
    async def owing(self, ref: common_pb2.KvSessionRef) -> AsyncIterator[None]:
        """A block that owns the session: leaving it however it ends (raised, cancelled, returned) with no Release of
        the session sent meanwhile sends one, so that no step of a pull (a transport's first-use check, opening the
        exporter's cache) leaves the session pinned until its TTL."""
        self._owed.add(ref.session_id)
        try:
            yield
        except BaseException:
            if ref.session_id in self._owed:
                await self.now(ref)
            raise
        finally:
            if ref.session_id in self._owed:
                self.later(ref)

    def later(self, ref: common_pb2.KvSessionRef) -> asyncio.Task:
        """A Release nobody waits for (it only frees the exporter's blocks), logged if it fails."""
        self._owed.discard(ref.session_id)
        task = asyncio.ensure_future(release_quietly(self.channels.get(ref.endpoint), ref.session_id))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def now(self, ref: common_pb2.KvSessionRef) -> None:
        """The Release of a pull that failed, finished even if the caller is cancelled meanwhile."""
        await asyncio.shield(self.later(ref))

    async def confirm(self, ref: common_pb2.KvSessionRef, what: str) -> None:
        """The Release that proves an unfenced read: released = true, the session held its blocks until now."""
        self._owed.discard(ref.session_id)
        try:
            release = await asyncio.shield(release_session(self.channels.get(ref.endpoint), ref.session_id))
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"KV session {ref.session_id} at {ref.endpoint} was read through {what}, but its "
                              f"release failed ({exc.code().name}: {exc.details()}); the read cannot be trusted")
        if not release.released:  # read blocks are not the session's: never use them
            raise NotFound(f"KV session {ref.session_id} at {ref.endpoint} was not held through the {what} read: "
                           f"{release.reason or 'expired or released'}")

    async def close(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)


class ChannelCache:
    """One channel per exporter endpoint, reused across pulls; `close` at shutdown."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, endpoint: str) -> grpc.aio.Channel:
        if endpoint not in self._channels:
            self._channels[endpoint] = channels.aio_channel(endpoint, options=_PULL_CHANNEL_OPTIONS)
        return self._channels[endpoint]

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(channel.close() for channel in channels))

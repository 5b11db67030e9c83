"""The importer's side of the KV data plane: negotiate a backend per session, pull, release.

For each KvSessionRef the puller tries the exporter's offered backends (best first) that this
worker accepts and can use here: `cuda_ipc` (exporter's GPU visible here), `nixl` (NIXL usable on
both sides), `shm` (same host), then `grpc`, which always works. A backend that cannot serve a peer
(BackendUnavailable: no shared GPU, another container, NIXL missing) is logged once per peer with
the reason, counted, skipped for that peer for a while, and the next one is tried; the session is
still pinned then, so nothing is lost. One-sided backends read the blocks themselves and then
release the session: only `released = true` proves the exporter held the blocks throughout, unless the
exporter fences its cache (common.kv.fence): then `cuda_ipc` on one GPU copies straight into blocks of this
worker's engine (common.kv.direct), the epochs prove the copy, and the Release goes out in the background.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import grpc
import torch

from common.errors import LayoutMismatch, NotFound, Unavailable
from common.engine.interface import KvBlocks
from common.kv import cuda_ipc, direct, gather, shm
from common.kv.backends import KV_CACHE_ID_ATTRIBUTE, PREFERENCE, BACKENDS, BackendUnavailable, offered
from common.kv.block_copy import BlockCopier
from common.kv.fence import EPOCHS_ATTRIBUTE
from common.kv.probe import SelfCheck
from common.kv.chunks import torch_dtype
from common.kv.layout import KvExport
from common.kv.sharing import nixl_unavailable_reason
from common.kv.transfer import (ChannelCache, PulledKv, check_pullable, layout_of, pull_kv, release_quietly,
                                release_session)
from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
RETRY_BROKEN_AFTER_S = 60.0  # a backend that failed for a peer is tried again after this


class KvPuller:
    def __init__(self, channels: ChannelCache, device: torch.device, accepted: tuple[str, ...] = PREFERENCE,
                 on_fallback: Callable[[str, str], None] | None = None, blocks: KvBlocks | None = None,
                 on_probe: Callable[[str, str, float], None] | None = None, self_check: bool = True):
        self.channels = channels
        self.device = device
        self.blocks = blocks  # the engine's cache and pool: cuda_ipc copies straight into its blocks
        self._releases: set[asyncio.Task] = set()  # Releases sent off the critical path, until answered
        self.self_check = SelfCheck(self, on_probe) if self_check else None
        self._map_lock = asyncio.Lock()
        self.accepted = tuple(b for b in accepted if self._usable_here(b)) or ("grpc",)
        self.on_fallback = on_fallback  # (backend, reason) → e.g. a metric
        self._broken: dict[tuple[str, str], float] = {}  # (endpoint, backend) → when it failed
        self._mappings = cuda_ipc.CudaIpcMappings()
        self._nixl = None
        self._nixl_peers: dict[str, tuple[str, object]] = {}  # endpoint → (kv_cache_id, NixlCacheInfo)

    def _usable_here(self, backend: str) -> bool:
        if backend == "cuda_ipc":
            return self.device.type == "cuda"
        if backend == "nixl":
            reason = nixl_unavailable_reason()
            if reason is not None:
                log.info("KV transfer backend nixl not used by this worker: %s", reason)
            return reason is None
        if backend == "shm":
            return bool(shm.host_id())
        return True

    def candidates(self, ref: common_pb2.KvSessionRef) -> list[str]:
        """The backends to try for this ref, in the exporter's order of preference; grpc last."""
        now = time.monotonic()
        out = []
        for backend in offered(ref.attributes, ref.transfer_backend):
            if backend not in self.accepted or not self._applies(backend, ref):
                continue
            failed_at = self._broken.get((ref.endpoint, backend))
            if failed_at is not None and now - failed_at < RETRY_BROKEN_AFTER_S:
                continue
            out.append(backend)
        return [b for b in out if b != "grpc"] + ["grpc"]

    def _applies(self, backend: str, ref: common_pb2.KvSessionRef) -> bool:
        if backend == "cuda_ipc":
            uuid = ref.attributes.get(cuda_ipc.DEVICE_UUID_ATTRIBUTE, "")
            return shm.same_host(ref.attributes) and cuda_ipc.local_index_of(uuid) is not None
        if backend == "shm":
            return shm.same_host(ref.attributes)
        return True

    async def pull_and_release(self, ref: common_pb2.KvSessionRef, timeout_s: float | None = None) -> PulledKv:
        """The session's KV (on this worker's device), the session released whatever happened.
        Raises grpc.aio.AioRpcError from the exporter, NotFound / Unavailable / LayoutMismatch."""
        check_pullable(ref)
        channel = self.channels.get(ref.endpoint)
        if self.self_check is not None:
            self.self_check.start(channel, ref)  # once per exporter, in the background
        for backend in self.candidates(ref):
            try:
                if backend == "cuda_ipc":
                    return await self._cuda_ipc(channel, ref, timeout_s)
                if backend == "nixl":
                    return await self._one_sided(channel, ref, backend, self.read_nixl, timeout_s)
                return await self._two_sided(channel, ref, backend, timeout_s)
            except BackendUnavailable as exc:
                self.fall_back(ref.endpoint, backend, str(exc))
        raise AssertionError("grpc is always a candidate and never unavailable")

    def fall_back(self, endpoint: str, backend: str, reason: str) -> None:
        first = (endpoint, backend) not in self._broken
        self._broken[(endpoint, backend)] = time.monotonic()
        if first:
            log.warning("KV transfer backend %s unavailable with %s: %s; falling back to the next backend",
                        backend, endpoint, reason)
        if self.on_fallback is not None:
            self.on_fallback(backend, reason)

    async def _two_sided(self, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef, backend: str,
                         timeout_s: float | None) -> PulledKv:
        try:
            pulled = await pull_kv(channel, ref, timeout_s=timeout_s, backend=backend,
                                   allocate=lambda n: gather.pinned_empty(n, self.device))
            blocks = await gather.to_device(pulled.export.blocks, self.device)
        except BackendUnavailable:
            raise  # the session stays pinned for the next backend
        except BaseException:
            await asyncio.shield(release_quietly(channel, ref.session_id))
            raise
        await asyncio.shield(release_quietly(channel, ref.session_id))
        export = KvExport(pulled.export.layout, pulled.export.num_tokens, blocks)
        return PulledKv(export, pulled.num_bytes, pulled.seconds, backend)

    async def _one_sided(self, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef, backend: str,
                         read: Callable[[grpc.aio.Channel, common_pb2.KvSessionRef], Awaitable[torch.Tensor]],
                         timeout_s: float | None) -> PulledKv:
        start = time.perf_counter()
        try:
            blocks = await asyncio.wait_for(read(channel, ref), timeout_s)
            read_s = time.perf_counter() - start
        except BackendUnavailable:
            raise
        except BaseException:
            await asyncio.shield(release_quietly(channel, ref.session_id))
            raise
        try:  # the read is only good if the session still held its blocks when it ended
            release = await asyncio.shield(release_session(channel, ref.session_id))
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"KV session {ref.session_id} at {ref.endpoint} was read through {backend}, but its "
                              f"release failed ({exc.code().name}: {exc.details()}); the read cannot be trusted")
        if not release.released:  # read blocks are not the session's: never use them
            raise NotFound(f"KV session {ref.session_id} at {ref.endpoint} was not held through the {backend} read: "
                           f"{release.reason or 'expired or released'}")
        export = KvExport(layout_of(ref), ref.num_tokens, blocks)
        export.validate()
        return PulledKv(export, blocks.numel() * blocks.element_size(), time.perf_counter() - start, backend, read_s)

    async def _open(self, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef, backend: str) -> worker_pb2.KvCacheShare:
        request = worker_pb2.OpenKvCacheRequest(backend=BACKENDS[backend])
        try:
            share = await worker_pb2_grpc.TensorStoreStub(channel).OpenKvCache(request, timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                raise BackendUnavailable(f"the exporter refused to share its cache: {exc.details()}") from None
            raise
        _check_share(share, ref)
        return share

    async def map_cache(self, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef) -> cuda_ipc.MappedCache:
        cache_id = ref.attributes.get(KV_CACHE_ID_ATTRIBUTE, "")
        mapped = self._mappings.get(ref.endpoint, cache_id)
        if mapped is None:
            async with self._map_lock:  # the self-check and the first pull arrive together
                mapped = self._mappings.get(ref.endpoint, cache_id)
                if mapped is None:
                    share = await self._open(channel, ref, "cuda_ipc")
                    mapped = await asyncio.to_thread(self._mappings.put, ref.endpoint, share,
                                                     ref.attributes.get(EPOCHS_ATTRIBUTE, ""))
        _check_block_ids(ref, mapped.tensor.shape[2])
        return mapped

    async def _cuda_ipc(self, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef,
                        timeout_s: float | None) -> PulledKv:
        """Straight into our engine's blocks where the exporter fences its cache and the pool has room; else a
        gather into a new tensor, confirmed by the Release."""
        mapped = await self.map_cache(channel, ref)
        if mapped.epochs is not None and direct.fence_of(ref) is not None and direct.can_place(mapped.tensor,
                                                                                                 self.blocks):
            pulled = await self._placed(channel, ref, mapped, timeout_s)
            if pulled is not None:
                return pulled

        async def read(_channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef) -> torch.Tensor:
            return await gather.gather_on_device(mapped.tensor, list(ref.block_ids), self.device)
        return await self._one_sided(channel, ref, "cuda_ipc", read, timeout_s)

    async def _placed(self, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef, mapped: cuda_ipc.MappedCache,
                      timeout_s: float | None) -> PulledKv | None:
        start, sent = time.perf_counter(), []

        def copied() -> None:
            sent.append(self._release_later(channel, ref))
        if mapped.copier is None:
            mapped.copier = BlockCopier(mapped.tensor, self.blocks.cache)
        try:
            placed = await asyncio.wait_for(direct.import_placed(
                mapped.copier, mapped.epochs, ref, layout_of(ref), self.blocks, copied), timeout_s)
        except BaseException:
            if not sent:
                self._release_later(channel, ref)
            raise
        if placed is None:  # no room in the pool now: nothing was copied or released
            return None
        seconds = time.perf_counter() - start
        num_bytes = len(ref.block_ids) * layout_of(ref).block_bytes()
        return PulledKv(placed, num_bytes, seconds, "cuda_ipc", seconds)

    def _release_later(self, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef) -> asyncio.Task:
        """The fenced read needs no answer: the Release only frees the exporter's blocks."""
        task = asyncio.ensure_future(release_quietly(channel, ref.session_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return task

    async def read_nixl(self, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef) -> torch.Tensor:
        from common.kv import nixl_plane

        cache_id = ref.attributes.get(KV_CACHE_ID_ATTRIBUTE, "")
        known = self._nixl_peers.get(ref.endpoint)
        if known is None or known[0] != cache_id:
            share = await self._open(channel, ref, "nixl")
            fields = {f.name: getattr(share.nixl, f.name) for f in share.nixl.DESCRIPTOR.fields}
            info = nixl_plane.NixlCacheInfo.from_fields(fields)
            if known is not None:
                self._nixl_importer().forget_peer(known[1].agent_name)
            self._nixl_peers[ref.endpoint] = known = (cache_id, info)
        info = known[1]
        _check_block_ids(ref, info.num_blocks)
        out = torch.empty(layout_of(ref).block_shape(len(ref.block_ids)), dtype=torch_dtype(ref.dtype),
                          device=self.device)
        try:
            await self._nixl_importer().read_blocks_async(info, list(ref.block_ids), out)
        except nixl_plane.TransferFailed as exc:
            self._nixl_peers.pop(ref.endpoint, None)
            raise Unavailable(f"NIXL read of KV session {ref.session_id} from {ref.endpoint} failed: {exc}") from None
        return out

    def _nixl_importer(self):
        if self._nixl is None:
            from common.kv import nixl_plane

            self._nixl = nixl_plane.NixlImporter()
        return self._nixl

    async def close(self) -> None:
        if self.self_check is not None:
            await self.self_check.close()
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)
        self._mappings.close()
        if self._nixl is not None:
            self._nixl.close()
            self._nixl = None


def _check_share(share: worker_pb2.KvCacheShare, ref: common_pb2.KvSessionRef) -> None:
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


def _check_block_ids(ref: common_pb2.KvSessionRef, num_blocks: int) -> None:
    bad = [b for b in ref.block_ids if b >= num_blocks]
    if bad:
        raise LayoutMismatch(f"KV session {ref.session_id} names blocks {bad[:8]} outside the exporter's "
                             f"{num_blocks} blocks")

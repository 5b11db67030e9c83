"""`cuda_ipc`: same host, the exporter's GPU visible here. Both halves: the exporter shares its whole cache once
(common.kv.ipc_share) and names its GPU in every ref; the importer maps it once per exporter cache (mapping.py) and
reads it GPU-side. Where the exporter fences its cache (common.kv.fence) and our pool has room, blocks go straight
into our engine's blocks (direct.py, by the copy of block_copy.py / peer_copy.py); else a gather into a new tensor.
Where the epochs are mapped here, they prove the copy and the Release goes out in the background; else the
Release's answer confirms it."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch
from opentelemetry import trace

from common.kv import gather, host
from common.kv.fence import EPOCHS_ATTRIBUTE, fence_of
from common.kv.ipc_share import device_uuid, local_index_of, share_cache
from common.kv.layout import layout_of
from common.kv.offer import KV_CACHE_ID_ATTRIBUTE
from common.kv.shards import KvShards
from common.kv.transport import Importer, KvTransport
from common.kv.transports.cuda_ipc import direct
from common.kv.transports.cuda_ipc.block_copy import BlockCopier, compile_for
from common.kv.transports.cuda_ipc.mapping import CudaIpcMappings, MappedCache
from common.kv.transports.one_sided import check_block_ids, open_share, read_one_sided
from common.kv.wire import PulledKv
from common.pb.disagg.v1 import common_pb2, worker_pb2


DEVICE_UUID_ATTRIBUTE = "cuda_device_uuid"  # the exporter's GPU, which the importer must see
# How long a pull waits for room in our pool (its running requests' growth kept free) before it gathers the session
# into memory beside the pool, as it did when the pool was short; the exporter keeps the session meanwhile.
ROOM_WAIT_S = 5.0

log = logging.getLogger(__name__)


class CudaIpcTransport(KvTransport):
    name = "cuda_ipc"
    fences_reads = True

    def __init__(self) -> None:
        self._mappings = CudaIpcMappings()
        self._map_lock = asyncio.Lock()

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None if device.type == "cuda" else "the KV cache is in host memory"

    def applies(self, ref: common_pb2.KvSessionRef) -> bool:
        uuid = ref.attributes.get(DEVICE_UUID_ATTRIBUTE, "")
        return host.same_host(ref.attributes) and local_index_of(uuid) is not None

    def offer(self, kv_cache: torch.Tensor | KvShards) -> dict[str, str]:
        return {DEVICE_UUID_ATTRIBUTE: device_uuid(kv_cache.device)}

    def share(self, kv_cache: torch.Tensor, kv_cache_id: str) -> worker_pb2.KvCacheShare:
        return share_cache(kv_cache, kv_cache_id)

    @classmethod
    def prepare_import(cls, cache: torch.Tensor | KvShards) -> None:
        """The copy kernel into our blocks, compiled now rather than on the first pull's critical path (a
        tensor-parallel cache's shards take the torch copy)."""
        if isinstance(cache, torch.Tensor):
            compile_for(cache)

    async def map_cache(self, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef) -> MappedCache:
        cache_id = ref.attributes.get(KV_CACHE_ID_ATTRIBUTE, "")
        mapped = self._mappings.get(ref.endpoint, cache_id)
        if mapped is None:
            async with self._map_lock:  # the self-check and the first pull arrive together
                mapped = self._mappings.get(ref.endpoint, cache_id)
                if mapped is None:
                    share = await open_share(channel, ref, self.name)
                    mapped = await asyncio.to_thread(self._mappings.put, ref.endpoint, share,
                                                     ref.attributes.get(EPOCHS_ATTRIBUTE, ""))
        check_block_ids(ref, mapped.tensor.shape[2])
        return mapped

    async def pull(self, puller: Importer, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef,
                   timeout_s: float | None) -> PulledKv:
        mapped = await self.map_cache(channel, ref)
        if mapped.epochs is not None and fence_of(ref) is not None and direct.can_place(mapped.tensor, puller.blocks):
            pulled = await self._placed(puller, channel, ref, mapped, timeout_s)
            if pulled is not None:
                return pulled

        async def read(_channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef) -> torch.Tensor:
            return await gather.gather_on_device(mapped.tensor, list(ref.block_ids), puller.device)
        return await read_one_sided(puller, channel, ref, self.name, read, timeout_s, mapped.epochs)

    async def _placed(self, puller: Importer, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef,
                      mapped: MappedCache, timeout_s: float | None) -> PulledKv | None:
        sent = []

        def copied() -> None:
            sent.append(puller.releases.later(ref))
        if mapped.copier is None:
            mapped.copier = BlockCopier(mapped.tensor, puller.blocks.cache)
        layout = layout_of(ref)
        waited = time.perf_counter()
        room_wait_s = ROOM_WAIT_S if timeout_s is None else min(ROOM_WAIT_S, timeout_s)
        reserved = await direct.reserve_with_room(puller.blocks, ref, room_wait_s)  # (import_placed owns them)
        start = time.perf_counter()
        trace.get_current_span().set_attribute("disagg.kv_pull.room_wait_s", start - waited)
        if reserved is None:  # still no room: the pull goes on another way (into memory beside the pool)
            log.warning("KV session %s: no room in the KV pool for %d blocks after %.1f s; pulling beside it",
                        ref.session_id, direct.blocks_for(ref), start - waited)
            return None
        try:
            placed = await direct.import_placed(mapped.copier, mapped.epochs, ref, layout, puller.blocks, copied,
                                                timeout_s, reserved)
        except BaseException:
            if not sent:
                puller.releases.later(ref)
            raise
        if placed is None:  # no room in the pool now: nothing was copied or released
            return None
        seconds = time.perf_counter() - start
        num_bytes = len(ref.block_ids) * layout.block_bytes()
        return PulledKv(placed, num_bytes, seconds, self.name, seconds)

    async def probe(self, puller: Importer, channel: grpc.aio.Channel, probe: common_pb2.KvSessionRef) -> int:
        mapped = (await self.map_cache(channel, probe)).tensor
        ids = list(probe.block_ids)
        if isinstance(mapped, KvShards):
            gathered = await gather.gather_on_device(mapped, ids, puller.device)
            return gathered.numel() * gathered.element_size()
        scratch = torch.empty(layout_of(probe).block_shape(len(ids)), dtype=mapped.dtype, device=puller.device)
        copier = BlockCopier(mapped, scratch)  # the copy a pull makes: a peer copy where the caches' GPUs differ
        stream = gather.side_stream(copier.device)
        reading = copier(ids, range(len(ids)), stream)  # read by the copy until it has finished
        event = gather.recorded_event(stream)
        await gather.wait_event(event)
        gather.recycle_event(event)
        del reading
        return scratch.numel() * scratch.element_size()

    def close(self) -> None:
        self._mappings.close()

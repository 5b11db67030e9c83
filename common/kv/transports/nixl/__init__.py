"""`nixl`: one-sided reads by descriptor from a NIXL agent that registered the exporter's whole cache
(plane.py): any host NIXL reaches, the cross-host fast path on RDMA fabrics. An exporter on this host
fences its cache (common.kv.fence): its epochs prove a read and the Release goes out unawaited; from another
host the Release's answer confirms it."""
from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch

from common.errors import Unavailable
from common.kv import host
from common.kv.chunks import dtype_name, torch_dtype
from common.kv.fence import EPOCHS_ATTRIBUTE, BlockEpochs, open_peer_table
from common.kv.layout import layout_of
from common.kv.offer import KV_CACHE_ID_ATTRIBUTE
from common.kv.transport import Importer, KvTransport
from common.kv.transports.one_sided import check_block_ids, open_share, read_one_sided
from common.kv.wire import PulledKv
from common.pb.disagg.v1 import common_pb2, worker_pb2


def nixl_unavailable_reason() -> str | None:
    try:
        from common.kv.transports.nixl import plane as nixl_plane
    except ImportError as exc:
        return f"NIXL support cannot be imported ({exc})"
    return nixl_plane.nixl_unavailable_reason()


@dataclass
class _Peer:
    kv_cache_id: str
    info: object  # nixl_plane.NixlCacheInfo
    epochs: BlockEpochs | None  # the exporter's fence, where it is on this host


class NixlTransport(KvTransport):
    name = "nixl"
    fences_reads = True
    reads_sharded_caches = False  # its agent registers one region: one rank's cache, not a TP engine's shards
    starts_on_first_use = True  # the agents; on the exporter, a progress thread (plane.py)

    def __init__(self) -> None:
        self._exporter = None  # the exporter's agent, made on the first share
        self._importer = None  # the importer's agent, made on the first read
        self._peers: dict[str, _Peer] = {}  # by endpoint

    def unavailable_reason(self, device: torch.device) -> str | None:
        return nixl_unavailable_reason()

    def share(self, kv_cache: torch.Tensor, kv_cache_id: str) -> worker_pb2.KvCacheShare:
        from common.kv.transports.nixl import plane as nixl_plane

        self._exporter = nixl_plane.NixlExporter(kv_cache)
        payload = worker_pb2.NixlShare(**self._exporter.info().to_fields()).SerializeToString()
        return worker_pb2.KvCacheShare(transport=self.name, kv_cache_id=kv_cache_id, shape=list(kv_cache.shape),
                                       dtype=dtype_name(kv_cache.dtype), payload=payload)

    async def pull(self, puller: Importer, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef,
                   timeout_s: float | None) -> PulledKv:
        peer = await self._peer(channel, ref)
        return await read_one_sided(puller, channel, ref, self.name, lambda c, r: self.read(puller.device, c, r),
                                    timeout_s, peer.epochs)

    async def probe(self, puller: Importer, channel: grpc.aio.Channel, probe: common_pb2.KvSessionRef) -> int:
        out = await self.read(puller.device, channel, probe)
        return out.numel() * out.element_size()

    async def read(self, device: torch.device, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef) -> torch.Tensor:
        from common.kv.transports.nixl import plane as nixl_plane

        info = (await self._peer(channel, ref)).info
        check_block_ids(ref, info.num_blocks)
        # Plain pages, not common.kv.buffers' huge ones: UCX's TCP reads into huge pages took less CPU but longer.
        out = torch.empty(layout_of(ref).block_shape(len(ref.block_ids)), dtype=torch_dtype(ref.dtype), device=device)
        try:
            await self._agent().read_blocks_async(info, list(ref.block_ids), out)
        except nixl_plane.TransferFailed as exc:
            self._peers.pop(ref.endpoint, None)  # its agent is never forgotten, its table unmapped once unused
            raise Unavailable(f"NIXL read of KV session {ref.session_id} from {ref.endpoint} failed: {exc}") from None
        return out

    async def _peer(self, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef) -> _Peer:
        """The exporter's registered cache, opened again when its cache changed (a restarted worker)."""
        from common.kv.transports.nixl import plane as nixl_plane

        cache_id = ref.attributes.get(KV_CACHE_ID_ATTRIBUTE, "")
        known = self._peers.get(ref.endpoint)
        if known is None or known.kv_cache_id != cache_id:
            share = await open_share(channel, ref, self.name)
            fields = worker_pb2.NixlShare.FromString(share.payload)
            info = nixl_plane.NixlCacheInfo.from_fields({f.name: getattr(fields, f.name)
                                                         for f in fields.DESCRIPTOR.fields})
            path = ref.attributes.get(EPOCHS_ATTRIBUTE, "") if host.same_host(ref.attributes) else ""
            epochs = open_peer_table(path, info.num_blocks, ref.endpoint)
            if known is not None:
                self._agent().forget_peer(known.info.agent_name)
                if known.epochs is not None:
                    known.epochs.close()
            self._peers[ref.endpoint] = known = _Peer(cache_id, info, epochs)
        return known

    def _agent(self):
        if self._importer is None:
            from common.kv.transports.nixl import plane as nixl_plane

            self._importer = nixl_plane.NixlImporter()
        return self._importer

    def close(self) -> None:
        for peer in self._peers.values():
            if peer.epochs is not None:
                peer.epochs.close()
        self._peers = {}
        for agent in (self._exporter, self._importer):
            if agent is not None:
                agent.close()
        self._exporter = self._importer = None

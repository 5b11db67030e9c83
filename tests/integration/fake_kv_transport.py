"""A KV transport that lives only in the tests: it registers itself when imported (workers import it through
DISAGG_KV_TRANSPORT_MODULES), touches nothing in common/, and moves a session's KV for real. Its exporter shares
a chunk size in the generic KvCacheShare's attributes and payload; its importer opens that share through
TensorStore.OpenKvCache and pulls the session through TensorStore.Pull in chunks of that size."""
from __future__ import annotations

import grpc
import torch

from common.kv import gather, transport
from common.kv.chunks import dtype_name
from common.kv.layout import KvExport
from common.kv.transports.grpc_pull import pull_chunks
from common.kv.transports.one_sided import open_share
from common.kv.wire import PulledKv, release_quietly
from common.pb.disagg.v1 import common_pb2, worker_pb2

NAME = "fake"
CHUNK_BYTES = 4096  # small, so every session crosses in many chunks


class FakeTransport(transport.KvTransport):
    name = NAME

    def share(self, kv_cache: torch.Tensor, kv_cache_id: str) -> worker_pb2.KvCacheShare:
        return worker_pb2.KvCacheShare(transport=NAME, kv_cache_id=kv_cache_id, shape=list(kv_cache.shape),
                                       dtype=dtype_name(kv_cache.dtype), attributes={"chunk_bytes": str(CHUNK_BYTES)},
                                       payload=NAME.encode())

    async def pull(self, puller, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef,
                   timeout_s: float | None) -> PulledKv:
        try:
            pulled = await self._pull(puller.device, channel, ref, timeout_s)
        except transport.TransportUnavailable:
            raise  # the session stays pinned for the next transport
        except BaseException:
            await release_quietly(channel, ref.session_id)
            raise
        await release_quietly(channel, ref.session_id)
        return pulled

    async def probe(self, puller, channel: grpc.aio.Channel, probe: common_pb2.KvSessionRef) -> int:
        return (await self._pull(puller.device, channel, probe, 30)).num_bytes

    async def _pull(self, device: torch.device, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef,
                    timeout_s: float | None) -> PulledKv:
        share = await open_share(channel, ref, NAME)
        if share.transport != NAME or share.payload != NAME.encode():
            raise transport.TransportUnavailable(f"the exporter shared {share.transport!r}, not the fake transport")
        pulled = await pull_chunks(channel, ref, max_chunk_bytes=int(share.attributes["chunk_bytes"]),
                                   timeout_s=timeout_s)
        blocks = await gather.to_device(pulled.export.blocks, device)
        export = KvExport(pulled.export.layout, pulled.export.num_tokens, blocks)
        return PulledKv(export, pulled.num_bytes, pulled.seconds, NAME)


transport.register(FakeTransport)

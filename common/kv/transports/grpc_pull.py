"""`grpc`: TensorStore.Pull chunks. Any host, always works: the last resort of every negotiation."""
from __future__ import annotations

import grpc

from common.kv.transfer import PulledKv, pull_chunks
from common.kv.transport import Importer, KvTransport
from common.kv.transports.two_sided import probe_two_sided, pull_two_sided
from common.pb.disagg.v1 import common_pb2


class GrpcTransport(KvTransport):
    name = "grpc"

    async def pull(self, puller: Importer, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef,
                   timeout_s: float | None) -> PulledKv:
        return await pull_two_sided(puller, channel, ref, self.name, pull_chunks, timeout_s)

    async def probe(self, puller: Importer, channel: grpc.aio.Channel, probe: common_pb2.KvSessionRef) -> int:
        return await probe_two_sided(puller, channel, probe, pull_chunks)

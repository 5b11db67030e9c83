"""`grpc`: TensorStore.Pull chunks. Any host, always works: the last resort of every negotiation."""
from __future__ import annotations

from common.kv.transport import KvTransport
from common.kv.transports.two_sided import probe_two_sided, pull_two_sided
from common.pb.disagg.v1 import common_pb2


class GrpcTransport(KvTransport):
    name = "grpc"
    number = common_pb2.TRANSFER_BACKEND_GRPC

    async def pull(self, puller, channel, ref, timeout_s):
        return await pull_two_sided(puller, channel, ref, self.name, timeout_s)

    async def probe(self, puller, channel, probe):
        return await probe_two_sided(puller, channel, probe, self.name)

"""`grpc`: TensorStore.Pull chunks. Any host, always works: the last resort of every negotiation."""
from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from common.kv.backends import BACKENDS
from common.kv.transfer import PulledKv, pull_chunks
from common.kv.transport import KvTransport
from common.kv.transports.two_sided import probe_two_sided, pull_two_sided
from common.pb.disagg.v1 import common_pb2

if TYPE_CHECKING:
    from common.kv.pull import KvPuller


class GrpcTransport(KvTransport):
    name = "grpc"
    number = BACKENDS[name]

    async def pull(self, puller: "KvPuller", channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef,
                   timeout_s: float | None) -> PulledKv:
        return await pull_two_sided(puller, channel, ref, self.name, pull_chunks, timeout_s)

    async def probe(self, puller: "KvPuller", channel: grpc.aio.Channel, probe: common_pb2.KvSessionRef) -> int:
        return await probe_two_sided(puller, channel, probe, pull_chunks)

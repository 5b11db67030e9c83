"""`shm`: same host; the exporter writes the session's bytes into the importer's /dev/shm file (common.kv.shm)."""
from __future__ import annotations

import grpc
import torch

from common.kv import shm
from common.kv.transfer import PulledKv, pull_shm
from common.kv.transport import Importer, KvTransport
from common.kv.transports.two_sided import probe_two_sided, pull_two_sided
from common.pb.disagg.v1 import common_pb2


class ShmTransport(KvTransport):
    name = "shm"

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None if shm.host_id() else "no /dev/shm or host id here"

    def applies(self, ref: common_pb2.KvSessionRef) -> bool:
        return shm.same_host(ref.attributes)

    async def pull(self, puller: Importer, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef,
                   timeout_s: float | None) -> PulledKv:
        return await pull_two_sided(puller, channel, ref, self.name, pull_shm, timeout_s)

    async def probe(self, puller: Importer, channel: grpc.aio.Channel, probe: common_pb2.KvSessionRef) -> int:
        return await probe_two_sided(puller, channel, probe, pull_shm)

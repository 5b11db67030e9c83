"""`shm`: same host; the exporter writes the session's bytes into the importer's /dev/shm file (common.kv.shm)."""
from __future__ import annotations

from common.kv import shm
from common.kv.transport import KvTransport
from common.kv.transports.two_sided import probe_two_sided, pull_two_sided
from common.pb.disagg.v1 import common_pb2


class ShmTransport(KvTransport):
    name = "shm"
    number = common_pb2.TRANSFER_BACKEND_SHM

    def unavailable_reason(self, device):
        return None if shm.host_id() else "no /dev/shm or host id here"

    def applies(self, ref):
        return shm.same_host(ref.attributes)

    async def pull(self, puller, channel, ref, timeout_s):
        return await pull_two_sided(puller, channel, ref, self.name, timeout_s)

    async def probe(self, puller, channel, probe):
        return await probe_two_sided(puller, channel, probe, self.name)

"""Who moves a worker's sessions' KV, picked once per worker by what its engine can do: an engine that moves KV
itself (an OwnKvTransfer) gets the transport it names, from the registry (common.kv.transport); one that hosts KV
sessions (a KvSessionHost) gets our data plane. The services use the KvPath they get and nothing else."""
from __future__ import annotations

import asyncio

import torch

from common.engine.interface import Engine, KvSessionHost, OwnKvTransfer
from common.errors import InvalidConfig, InvalidRequest, NotFound
from common.kv import transport
from common.kv.block_copy import compile_for
from common.kv.sharing import KvCacheExporter
from common.kv.errors import BackendUnavailable
from common.kv.transport import KvPath
from common.pb.disagg.v1 import common_pb2, worker_pb2


class DataPlane(KvPath):
    """Our KV data plane: a KvSessionHost's pinned blocks served by TensorStore over the transports negotiated per
    session (the exporter's KvCacheExporter; the importer's KvPuller, in the decode service)."""

    moves = transport.DATA_PLANE_MOVES

    def __init__(self, engine_name: str, accepted: tuple[str, ...], exporter: KvCacheExporter | None = None):
        super().__init__(engine_name)
        self.accepted = accepted  # --kv-transfer-backends
        self.exporter = exporter  # a prefill worker's: its cache and shares

    def carries(self, transfer_backend: int) -> bool:
        return transport.driving_engine_transport(transfer_backend) is None

    def transfer_backends(self) -> list[int]:
        names = self.exporter.offered if self.exporter is not None else self.accepted
        return [transport.number_of(name) for name in names]

    async def ref_fields(self, session_id: str) -> tuple[int, dict[str, str]]:
        exporter = self.cache_exporter(session_id)  # its attributes, without a trip to the engine's thread
        return exporter.best_backend, exporter.attributes()

    def cache_exporter(self, handle: str) -> KvCacheExporter:
        if self.exporter is None:
            raise NotFound(f"this worker exports no KV sessions (no {handle})")
        return self.exporter

    def share(self, name: str) -> worker_pb2.KvCacheShare:
        if self.exporter is None:
            raise BackendUnavailable("this worker exports no KV cache")
        return self.exporter.share(name)

    def check_ref(self, ref: common_pb2.KvSessionRef) -> None:
        check_pullable(ref)

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()


def check_pullable(ref: common_pb2.KvSessionRef) -> None:
    """Refuse a ref the data plane cannot pull, before any bytes move."""
    if not transport.pullable(ref.transfer_backend):
        name = common_pb2.TransferBackend.Name(ref.transfer_backend) if ref.transfer_backend in \
            common_pb2.TransferBackend.values() else str(ref.transfer_backend)
        pulled = ", ".join(map(common_pb2.TransferBackend.Name, transport.pulled_numbers()))
        raise InvalidRequest(f"transfer backend {name} is not supported here; this worker pulls over {pulled}")
    if not ref.session_id or not ref.endpoint:
        raise InvalidRequest("the KV session ref needs a session_id and an endpoint")
    num_blocks = -(-ref.num_tokens // ref.block_size) if ref.block_size else -1
    if num_blocks != len(ref.block_ids):
        raise InvalidRequest(f"the KV session ref lists {len(ref.block_ids)} blocks for {ref.num_tokens} tokens "
                             f"of block size {ref.block_size}")


async def open_path(engine: Engine, exports: bool, accepted: tuple[str, ...], worker_id: str) -> KvPath:
    """The worker's KvPath; a data plane exporter (`exports`: prefill) shares its engine's cache with importers."""
    name = (await engine.facts()).name
    if isinstance(engine, OwnKvTransfer):
        return transport.engine_transport(engine.kv_transport, engine, name)
    if not isinstance(engine, KvSessionHost):
        raise InvalidConfig(f"--engine {name} neither hosts KV sessions for the KV data plane nor moves KV itself")
    exporter = None
    if exports:
        blocks = await engine.kv_blocks()
        exporter = KvCacheExporter(blocks.cache, accepted, worker_id, blocks.count_reuse)
    elif "cuda_ipc" in accepted:  # an importer: cuda_ipc copies into its blocks with a kernel to compile first
        cache = (await engine.kv_blocks()).cache
        if isinstance(cache, torch.Tensor):  # (a tensor-parallel cache's shards take the torch copy)
            await asyncio.to_thread(compile_for, cache)
    return DataPlane(name, accepted, exporter)

"""The KV transport protocol and the registry that loads transports lazily by name (torch-free: the router reads
names and numbers here).

A transport moves a pinned session's blocks from an exporter (prefill) to an importer (decode). Those of our KV
data plane (`KvTransport`) hold both halves: the exporter's says whether it can run there and shares the cache
where it reads one-sided; the importer's says whether it applies to a ref and pulls a session into local blocks.
The importer negotiates among them per session. An engine may instead drive a transport of its own
(common.kv.paths.EngineTransport: TensorRT-LLM's cache transceiver), which the worker then uses alone. Either way a
worker's services see one KvPath (common.kv.paths picks it by what the engine can do).

Each transport has one row in the registry (name, TransferBackend, class): the built-ins in BUILT_IN, their
packages under common/kv/transports/; `grpc` is always the data plane's last resort. Another one is a module that
calls `register`: name it in DISAGG_KV_TRANSPORT_MODULES (comma separated) and every worker imports it before its
first lookup.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from common.errors import InvalidConfig
from common.kv.errors import TransportUnavailable
from common.pb.disagg.v1 import common_pb2, worker_pb2

if TYPE_CHECKING:  # the router reads names and numbers here without torch
    import grpc
    import torch

    from common.kv.blocks import KvBlocks
    from common.kv.shards import KvShards
    from common.kv.wire import PulledKv, Releases

MODULES_ENV = "DISAGG_KV_TRANSPORT_MODULES"
FALLBACK = "grpc"


class Importer(Protocol):
    """What a transport's importing side sees of the worker it pulls for (common.kv.pull.KvPuller)."""

    device: torch.device  # where pulled blocks go
    blocks: KvBlocks | None  # the engine's cache and pool: a one-sided read may copy straight into its blocks
    releases: Releases  # every Release it sends, from one place


class KvTransport(ABC):
    """One transport, held by one exporter or one importer (its state — mappings, agents — is theirs)."""

    name: str  # its row's (BUILT_IN); one registered from outside may also declare its TransferBackend `number`
    driven_by_engine = False
    fences_reads: bool = False  # its reads need the exporter's block epochs (common.kv.fence)
    reads_sharded_caches: bool = True  # it can export a tensor-parallel cache on several GPUs (common.kv.shards)
    # Its first use starts what then runs until the worker stops (NIXL's agents, the exporter's progress thread): the
    # self-check (common.kv.probe) tries it only when no better transport works, so that it starts only where used.
    starts_on_first_use: bool = False

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why it cannot run in this process with a cache (or pulls) on `device`; None when it can."""
        return None

    def applies(self, ref: common_pb2.KvSessionRef) -> bool:
        """Whether it can move this ref's blocks from its exporter to this importer."""
        return True

    def offer(self, kv_cache: torch.Tensor | KvShards) -> dict[str, str]:
        """The exporter's side: what every ref of an exporter offering it carries besides the offer (cuda_ipc: the
        cache's GPU)."""
        return {}

    def share(self, kv_cache: torch.Tensor, kv_cache_id: str) -> worker_pb2.KvCacheShare:
        """The exporter's side of a one-sided transport: its cache, shared once for every importer."""
        raise TransportUnavailable(f"{self.name} shares no cache: its importers pull through TensorStore.Pull")

    @classmethod
    def prepare_import(cls, cache: torch.Tensor | KvShards) -> None:
        """The importer's side, as its worker starts (before any pull): what would otherwise fall on the first pull's
        critical path (cuda_ipc: compiling its copy kernel into `cache`, the engine's)."""

    @abstractmethod
    async def pull(self, puller: Importer, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef,
                   timeout_s: float | None) -> "PulledKv":
        """The importer's side: the session's blocks on the puller's device, the session released.
        TransportUnavailable (the session still pinned) when it cannot serve this exporter."""

    @abstractmethod
    async def probe(self, puller: Importer, channel: grpc.aio.Channel, probe: common_pb2.KvSessionRef) -> int:
        """Reads a probe ref's blocks (common.kv.probe) into scratch memory, holding nothing; the bytes read."""

    def close(self) -> None:
        """Frees what this side holds (mappings, agents)."""


@dataclass(frozen=True)
class Registration:
    """A transport's row in the registry: its name (--kv-transports), the TransferBackend refs and usage name
    it by (UNSPECIFIED for one the enum lacks), and its class, or "module:Class" imported on first use."""

    name: str
    number: int
    cls: str | type  # a KvTransport, or an EngineTransport (common.kv.paths) driven by its engine
    driven_by_engine: bool = False  # an EngineTransport, not one of the data plane's


# The built-in transports, each in one row: the data plane's best first (grpc, the last resort, last), then those an
# engine drives. Adding one is a package under common/kv/transports/ and a row here (or `register` from outside).
BUILT_IN = (
    Registration("cuda_ipc", common_pb2.TRANSFER_BACKEND_CUDA_IPC, "common.kv.transports.cuda_ipc:CudaIpcTransport"),
    Registration("shm", common_pb2.TRANSFER_BACKEND_SHM, "common.kv.transports.shm:ShmTransport"),
    Registration("nixl", common_pb2.TRANSFER_BACKEND_NIXL, "common.kv.transports.nixl:NixlTransport"),
    Registration(FALLBACK, common_pb2.TRANSFER_BACKEND_GRPC, "common.kv.transports.grpc_pull:GrpcTransport"),
    Registration("trtllm", common_pb2.TRANSFER_BACKEND_TRTLLM, "common.kv.transports.trtllm:TrtLlmTransport",
                 driven_by_engine=True),
)
DATA_PLANE_MOVES = "over the KV data plane (TensorStore: " + \
    ", ".join(row.name for row in BUILT_IN if not row.driven_by_engine) + ")"
_rows: dict[str, Registration] = {row.name: row for row in BUILT_IN}
_modules_loaded = False


def register(transport: type) -> None:
    """Adds (or replaces) a transport from outside: a KvTransport of the data plane (tried ahead of grpc), or an
    EngineTransport (common.kv.paths) an engine drives. Its class names it (`name`) and, where the enum has one,
    its TransferBackend (`number`)."""
    number = getattr(transport, "number", common_pb2.TRANSFER_BACKEND_UNSPECIFIED)
    if transport.driven_by_engine and number == common_pb2.TRANSFER_BACKEND_UNSPECIFIED:
        raise InvalidConfig(f"engine-driven KV transport {transport.name} needs a TransferBackend number: refs name "
                            "it by that")
    _rows.pop(transport.name, None)
    _rows[transport.name] = Registration(transport.name, number, transport, transport.driven_by_engine)


def unregister(name: str) -> None:
    if any(row.name == name for row in BUILT_IN):
        raise InvalidConfig(f"{name} is a built-in KV transport")
    _rows.pop(name, None)


def names() -> tuple[str, ...]:
    """The data plane's transports, best first, grpc last (what --kv-transports chooses from)."""
    _load_modules()
    data_plane = [row.name for row in _rows.values() if not row.driven_by_engine and row.name != FALLBACK]
    return (*data_plane, FALLBACK)


def create(name: str) -> KvTransport:
    """A new instance of the data plane's transport of that name; its module is imported on first use."""
    return class_of(name)()


def class_of(name: str) -> type[KvTransport]:
    """The data plane's transport of that name; its module is imported on first use."""
    return _class_of(name, driven_by_engine=False)


def engine_transport(name: str, *args: Any) -> Any:
    """The EngineTransport an engine drives, made with `args`; its module is imported on first use."""
    return _class_of(name, driven_by_engine=True)(*args)


def number_of(name: str) -> int:
    """The TransferBackend a ref or usage names this transport by (UNSPECIFIED for one the enum lacks)."""
    return _row(name).number


def pullable(transfer_backend: int) -> bool:
    """Whether a ref naming this TransferBackend is pulled over the data plane (UNSPECIFIED: by one the enum lacks)."""
    _load_modules()
    return transfer_backend == common_pb2.TRANSFER_BACKEND_UNSPECIFIED or any(
        row.number == transfer_backend for row in _rows.values() if not row.driven_by_engine)


def pulled_numbers() -> list[int]:
    """The TransferBackends of the data plane's transports that the enum has, best first."""
    return [number for number in map(number_of, names()) if number != common_pb2.TRANSFER_BACKEND_UNSPECIFIED]


def driving_engine_transport(transfer_backend: int) -> type | None:
    """The engine-driven transport a ref naming this TransferBackend was exported for; None: the data plane's."""
    _load_modules()
    for row in tuple(_rows.values()):
        if row.driven_by_engine and row.number == transfer_backend:
            return _class_of(row.name, driven_by_engine=True)
    return None


def moves_of(transfer_backend: int) -> str:
    """How the KV of a ref naming this TransferBackend moves, in words (KvPath.check)."""
    found = driving_engine_transport(transfer_backend)
    return DATA_PLANE_MOVES if found is None else found.moves


def _row(name: str, driven_by_engine: bool | None = None) -> Registration:
    _load_modules()
    row = _rows.get(name)
    if row is None or driven_by_engine not in (None, row.driven_by_engine):
        known = [r.name for r in _rows.values() if driven_by_engine in (None, r.driven_by_engine)]
        raise InvalidConfig(f"unknown KV transport {name!r}; known: {known}")
    return row


def _class_of(name: str, driven_by_engine: bool) -> Any:
    row = _row(name, driven_by_engine)
    if isinstance(row.cls, str):
        module, _, cls = row.cls.partition(":")
        row = _rows[name] = dataclasses.replace(row, cls=getattr(importlib.import_module(module), cls))
    return row.cls


def _load_modules() -> None:
    global _modules_loaded
    if _modules_loaded:
        return
    _modules_loaded = True
    for module in filter(None, (m.strip() for m in os.environ.get(MODULES_ENV, "").split(","))):
        importlib.import_module(module)

"""The KV transport protocols and the registry that loads transports lazily by name.

A transport moves a pinned session's blocks from an exporter (prefill) to an importer (decode). Those of our KV
data plane (`KvTransport`) say whether they can run here, whether they apply to a ref, share the exporter's cache
where they read one-sided, and pull a session into local blocks on the importer; the importer negotiates among
them per session. An `EngineTransport` is one its engine drives itself (TensorRT-LLM's cache transceiver): the
worker uses it alone. Either way a worker's services see one `KvPath` (common.kv.paths picks it by what the engine
can do). The built-in transports live in common/kv/transports/; `grpc` is always the data plane's last resort.
Another one is a module that calls `register`: name it in DISAGG_KV_TRANSPORT_MODULES (comma separated) and every
worker imports it before its first lookup.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from common.errors import FailedPrecondition, InvalidConfig, InvalidRequest
from common.kv.errors import BackendUnavailable
from common.pb.disagg.v1 import common_pb2, worker_pb2

if TYPE_CHECKING:  # the router reads names and numbers here without torch
    import asyncio

    import grpc
    import torch

    from common.engine.interface import KvImport, OwnKvTransfer
    from common.kv.blocks import KvBlocks
    from common.kv.sharing import KvCacheExporter
    from common.kv.transfer import PulledKv

MODULES_ENV = "DISAGG_KV_TRANSPORT_MODULES"
FALLBACK = "grpc"


class Importer(Protocol):
    """What a transport's importing side sees of the worker it pulls for (common.kv.pull.KvPuller)."""

    device: torch.device  # where pulled blocks go
    blocks: KvBlocks | None  # the engine's cache and pool: a one-sided read may copy straight into its blocks

    def release_later(self, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef) -> asyncio.Task:
        """A Release nobody waits for (the read is proven the session's: it only frees the exporter's blocks)."""


class KvTransport(ABC):
    """One transport, held by one exporter or one importer (its state — mappings, agents — is theirs)."""

    name: str  # its row's (BUILT_IN); one registered from outside may also declare its TransferBackend `number`
    driven_by_engine = False
    fences_reads: bool = False  # its reads need the exporter's block epochs (common.kv.fence)
    reads_sharded_caches: bool = True  # it can export a tensor-parallel cache on several GPUs (common.kv.shards)
    # Its first use starts what then runs until the worker stops (NIXL's agents, the exporter's progress thread): the
    # self-check (common.kv.probe) tries it only when no better backend works, so that it starts only where used.
    starts_on_first_use: bool = False

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why it cannot run in this process with a cache (or pulls) on `device`; None when it can."""
        return None

    def applies(self, ref: common_pb2.KvSessionRef) -> bool:
        """Whether it can move this ref's blocks from its exporter to this importer."""
        return True

    def share(self, kv_cache: torch.Tensor, kv_cache_id: str) -> worker_pb2.KvCacheShare:
        """The exporter's side of a one-sided transport: its cache, shared once for every importer."""
        raise BackendUnavailable(f"{self.name} shares no cache: its importers pull through TensorStore.Pull")

    @abstractmethod
    async def pull(self, puller: Importer, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef,
                   timeout_s: float | None) -> "PulledKv":
        """The importer's side: the session's blocks on the puller's device, the session released.
        BackendUnavailable (the session still pinned) when it cannot serve this exporter."""

    @abstractmethod
    async def probe(self, puller: Importer, channel: grpc.aio.Channel, probe: common_pb2.KvSessionRef) -> int:
        """Reads a probe ref's blocks (common.kv.probe) into scratch memory, holding nothing; the bytes read."""

    def close(self) -> None:
        """Frees what this side holds (mappings, agents)."""


class KvPath(ABC):
    """How one worker's sessions' KV moves, the only KV seam its services use: our data plane for an engine that
    hosts KV sessions (common.kv.paths.DataPlane), or the EngineTransport its engine drives."""

    moves: str  # how, in words, for a refusal that names both sides

    def __init__(self, engine_name: str) -> None:
        self.engine_name = engine_name  # the worker's --engine

    @abstractmethod
    def carries(self, transfer_backend: int) -> bool:
        """Whether the KV of a ref naming this TransferBackend moves this way."""

    @abstractmethod
    def transfer_backends(self) -> list[int]:
        """What this worker offers (prefill) or accepts (decode), best first (Worker/GetInfo)."""

    @abstractmethod
    async def ref_fields(self, session_id: str) -> tuple[int, dict[str, str]]:
        """Exporter: a pinned session's KvSessionRef.transfer_backend and attributes."""

    @abstractmethod
    def cache_exporter(self, handle: str) -> "KvCacheExporter":
        """Exporter: the cache TensorStore.Pull reads a session from; NotFound / BackendUnavailable saying why none."""

    @abstractmethod
    def share(self, name: str) -> worker_pb2.KvCacheShare:
        """Exporter: TensorStore.OpenKvCache's answer for transport `name`; BackendUnavailable with the reason."""

    def check(self, ref: common_pb2.KvSessionRef) -> None:
        """Importer: FailedPrecondition naming both sides when the ref's KV moves another way (a trtllm prefill's
        ref at a torch decode worker, or the reverse); InvalidRequest when this way cannot use the ref."""
        if not self.carries(ref.transfer_backend):
            number = ref.transfer_backend
            name = common_pb2.TransferBackend.Name(number) if number in common_pb2.TransferBackend.values() \
                else str(number)
            raise FailedPrecondition(
                f"KV session {ref.session_id} was exported with transfer_backend {name}, to be moved "
                f"{moves_of(number)}, but this decode worker runs --engine {self.engine_name}, which imports KV only "
                f"{self.moves}; run prefill and decode workers with the same --engine")
        self.check_ref(ref)

    @abstractmethod
    def check_ref(self, ref: common_pb2.KvSessionRef) -> None:
        """Importer: InvalidRequest for a ref of this way that it cannot use."""

    def handoff(self, ref: common_pb2.KvSessionRef) -> "KvImport | None":
        """Importer: the engine's kv_import made from the ref alone, its engine then fetching the KV itself (the
        importer releases the session once the engine has answered); None: the KV is pulled (KvPuller)."""
        return None

    def close(self) -> None:
        """Frees what the worker's side holds (shares, agents)."""


class EngineTransport(KvPath):
    """A transport its engine drives itself, named by an OwnKvTransfer engine (`kv_transport`). Nothing goes through
    TensorStore.Pull: the exporter's ref carries the engine's own handoff (Engine.session_attributes) and no block
    ids; the importer's engine rebuilds its kv_import from them (kv_import_from_attributes) and fetches the KV.
    Refs name it by its own TransferBackend (its row's `number`)."""

    name: str  # its row's (BUILT_IN); one registered from outside also declares its TransferBackend `number`
    driven_by_engine = True

    def __init__(self, engine: "OwnKvTransfer", engine_name: str) -> None:
        super().__init__(engine_name)
        self.engine = engine

    def carries(self, transfer_backend: int) -> bool:
        return transfer_backend == number_of(self.name)

    def transfer_backends(self) -> list[int]:
        return [number_of(self.name)]

    async def ref_fields(self, session_id: str) -> tuple[int, dict[str, str]]:
        return number_of(self.name), await self.engine.session_attributes(session_id)

    def cache_exporter(self, handle: str) -> "KvCacheExporter":
        raise BackendUnavailable(f"the KV of session {handle} moves through this worker's engine ({self.name}), "
                                 "not TensorStore.Pull")

    def share(self, name: str) -> worker_pb2.KvCacheShare:
        raise BackendUnavailable("this worker exports no KV cache")

    def check_ref(self, ref: common_pb2.KvSessionRef) -> None:
        if not ref.session_id or not ref.endpoint:
            raise InvalidRequest("the KV session ref needs a session_id and an endpoint (its release goes there)")

    def handoff(self, ref: common_pb2.KvSessionRef) -> "KvImport":
        return self.engine.kv_import_from_attributes(ref.attributes)


@dataclass(frozen=True)
class Registration:
    """A transport's row in the registry: its name (--kv-transfer-backends), the TransferBackend refs and usage name
    it by (UNSPECIFIED for one the enum lacks), and its class, or "module:Class" imported on first use."""

    name: str
    number: int
    cls: str | type[KvTransport] | type[EngineTransport]
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


def register(transport: type[KvTransport] | type[EngineTransport]) -> None:
    """Adds (or replaces) a transport from outside: one of the data plane (tried ahead of grpc), or one an engine
    drives. Its class names it (`name`) and, where the enum has one, its TransferBackend (`number`)."""
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
    """The data plane's transports, best first, grpc last (what --kv-transfer-backends chooses from)."""
    _load_modules()
    data_plane = [row.name for row in _rows.values() if not row.driven_by_engine and row.name != FALLBACK]
    return (*data_plane, FALLBACK)


def create(name: str) -> KvTransport:
    """A new instance of the data plane's transport of that name; its module is imported on first use."""
    return _class_of(name, driven_by_engine=False)()


def engine_transport(name: str, engine: "OwnKvTransfer", engine_name: str) -> EngineTransport:
    """The transport an engine drives, for that engine; its module is imported on first use."""
    return _class_of(name, driven_by_engine=True)(engine, engine_name)


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


def driving_engine_transport(transfer_backend: int) -> type[EngineTransport] | None:
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

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

import importlib
import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from common.errors import FailedPrecondition, InvalidConfig, InvalidRequest
from common.kv.errors import BackendUnavailable
from common.pb.disagg.v1 import common_pb2, worker_pb2

if TYPE_CHECKING:  # the router reads names and numbers here without torch
    import grpc
    import torch

    from common.engine.interface import KvImport, OwnKvTransfer
    from common.kv.pull import KvPuller
    from common.kv.sharing import KvCacheExporter
    from common.kv.transfer import PulledKv

MODULES_ENV = "DISAGG_KV_TRANSPORT_MODULES"
FALLBACK = "grpc"


class KvTransport(ABC):
    """One transport, held by one exporter or one importer (its state — mappings, agents — is theirs)."""

    name: str
    number: int = common_pb2.TRANSFER_BACKEND_UNSPECIFIED  # the TransferBackend a ref or usage names it by
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
    async def pull(self, puller: "KvPuller", channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef,
                   timeout_s: float | None) -> "PulledKv":
        """The importer's side: the session's blocks on the puller's device, the session released.
        BackendUnavailable (the session still pinned) when it cannot serve this exporter."""

    @abstractmethod
    async def probe(self, puller: "KvPuller", channel: grpc.aio.Channel, probe: common_pb2.KvSessionRef) -> int:
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
    Refs name it by its own TransferBackend `number`."""

    name: str
    number: int

    def __init__(self, engine: "OwnKvTransfer", engine_name: str) -> None:
        super().__init__(engine_name)
        self.engine = engine

    def carries(self, transfer_backend: int) -> bool:
        return transfer_backend == self.number

    def transfer_backends(self) -> list[int]:
        return [self.number]

    async def ref_fields(self, session_id: str) -> tuple[int, dict[str, str]]:
        return self.number, await self.engine.session_attributes(session_id)

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


_BUILT_IN = {"cuda_ipc": "common.kv.transports.cuda_ipc:CudaIpcTransport",
             "shm": "common.kv.transports.shm:ShmTransport",
             "nixl": "common.kv.transports.nixl:NixlTransport",
             "grpc": "common.kv.transports.grpc_pull:GrpcTransport"}
_BUILT_IN_ENGINE = {"trtllm": "common.kv.transports.trtllm:TrtLlmTransport"}
DATA_PLANE_MOVES = "over the KV data plane (TensorStore: " + ", ".join(_BUILT_IN) + ")"
_registered: dict[str, str | type[KvTransport]] = dict(_BUILT_IN)  # the data plane's, best first; grpc stays last
_engine_driven: dict[str, str | type[EngineTransport]] = dict(_BUILT_IN_ENGINE)
_modules_loaded = False


def register(transport: type[KvTransport] | type[EngineTransport]) -> None:
    """Adds (or replaces) a transport: one of the data plane ahead of grpc, or one an engine drives."""
    driven = issubclass(transport, EngineTransport)
    if driven and transport.number == common_pb2.TRANSFER_BACKEND_UNSPECIFIED:
        raise InvalidConfig(f"engine-driven KV transport {transport.name} needs a TransferBackend number: refs name "
                            "it by that")
    _registered.pop(transport.name, None)
    _engine_driven.pop(transport.name, None)
    if driven:
        _engine_driven[transport.name] = transport
        return
    fallback = _registered.pop(FALLBACK)
    _registered[transport.name] = transport
    _registered[FALLBACK] = fallback


def unregister(name: str) -> None:
    if name in _BUILT_IN or name in _BUILT_IN_ENGINE:
        raise InvalidConfig(f"{name} is a built-in KV transport")
    _registered.pop(name, None)
    _engine_driven.pop(name, None)


def names() -> tuple[str, ...]:
    """The data plane's transports, best first, grpc last (what --kv-transfer-backends chooses from)."""
    _load_modules()
    return tuple(_registered)


def create(name: str) -> KvTransport:
    """A new instance of the data plane's transport of that name; its module is imported on first use."""
    return _class_of(name, _registered)()


def engine_transport(name: str, engine: "OwnKvTransfer", engine_name: str) -> EngineTransport:
    """The transport an engine drives, for that engine; its module is imported on first use."""
    return _class_of(name, _engine_driven)(engine, engine_name)


def number_of(name: str) -> int:
    """The TransferBackend a ref or usage names this transport by (UNSPECIFIED for one the enum lacks)."""
    return _class_of(name, _engine_driven if name in _engine_driven else _registered).number


def driving_engine_transport(transfer_backend: int) -> type[EngineTransport] | None:
    """The engine-driven transport a ref naming this TransferBackend was exported for; None: the data plane's."""
    for name in tuple(_engine_driven):
        found = _class_of(name, _engine_driven)
        if found.number == transfer_backend:
            return found
    return None


def moves_of(transfer_backend: int) -> str:
    """How the KV of a ref naming this TransferBackend moves, in words (KvPath.check)."""
    found = driving_engine_transport(transfer_backend)
    return DATA_PLANE_MOVES if found is None else found.moves


def _class_of(name: str, table: dict[str, Any]) -> Any:
    _load_modules()
    if name not in table:
        raise InvalidConfig(f"unknown KV transport {name!r}; known: {list(table)}")
    found = table[name]
    if isinstance(found, str):
        module, _, cls = found.partition(":")
        found = table[name] = getattr(importlib.import_module(module), cls)
    return found


def _load_modules() -> None:
    global _modules_loaded
    if _modules_loaded:
        return
    _modules_loaded = True
    for module in filter(None, (m.strip() for m in os.environ.get(MODULES_ENV, "").split(","))):
        importlib.import_module(module)

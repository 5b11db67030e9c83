"""The KV transport protocol and the registry that loads transports lazily by name.

A transport moves a pinned session's blocks from an exporter (prefill) to an importer (decode). It says
whether it can run here, whether it applies to a ref, shares the exporter's cache where it reads one-sided,
and pulls a session into local blocks on the importer. The built-in ones, best first, live in
common/kv/transports/; `grpc` is always the last resort. Another one is a module that calls `register`:
name it in DISAGG_KV_TRANSPORT_MODULES (comma separated) and every worker imports it before its first lookup.
"""
from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from common.errors import FailedPrecondition, InvalidConfig
from common.pb.disagg.v1 import common_pb2, worker_pb2

if TYPE_CHECKING:  # the router reads names and numbers here without torch
    import grpc
    import torch

    from common.kv.pull import KvPuller
    from common.kv.transfer import PulledKv

MODULES_ENV = "DISAGG_KV_TRANSPORT_MODULES"
FALLBACK = "grpc"


class BackendUnavailable(FailedPrecondition):
    """This transport cannot move KV between these two workers; the importer tries the next one."""


class KvTransport(ABC):
    """One transport, held by one exporter or one importer (its state — mappings, agents — is theirs)."""

    name: str
    number: int = common_pb2.TRANSFER_BACKEND_UNSPECIFIED  # the TransferBackend a ref or usage names it by
    fences_reads: bool = False  # its reads need the exporter's block epochs (common.kv.fence)

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


_BUILT_IN = {"cuda_ipc": "common.kv.transports.cuda_ipc:CudaIpcTransport",
             "shm": "common.kv.transports.shm:ShmTransport",
             "nixl": "common.kv.transports.nixl:NixlTransport",
             "grpc": "common.kv.transports.grpc_pull:GrpcTransport"}
_registered: dict[str, str | type[KvTransport]] = dict(_BUILT_IN)  # best first; grpc stays last
_modules_loaded = False


def register(transport: type[KvTransport]) -> None:
    """Adds (or replaces) a transport, ahead of grpc."""
    _registered.pop(transport.name, None)
    fallback = _registered.pop(FALLBACK)
    _registered[transport.name] = transport
    _registered[FALLBACK] = fallback


def unregister(name: str) -> None:
    if name in _BUILT_IN:
        raise InvalidConfig(f"{name} is a built-in KV transport")
    _registered.pop(name, None)


def names() -> tuple[str, ...]:
    """Every transport, best first, grpc last."""
    _load_modules()
    return tuple(_registered)


def create(name: str) -> KvTransport:
    """A new instance of the transport of that name; its module is imported on first use."""
    return _class_of(name)()


def number_of(name: str) -> int:
    """The TransferBackend a ref or usage names this transport by (UNSPECIFIED for one the enum lacks)."""
    return _class_of(name).number


def _class_of(name: str) -> type[KvTransport]:
    _load_modules()
    if name not in _registered:
        raise InvalidConfig(f"unknown KV transport {name!r}; known: {list(_registered)}")
    found = _registered[name]
    if isinstance(found, str):
        module, _, cls = found.partition(":")
        found = _registered[name] = getattr(importlib.import_module(module), cls)
    return found


def _load_modules() -> None:
    global _modules_loaded
    if _modules_loaded:
        return
    _modules_loaded = True
    for module in filter(None, (m.strip() for m in os.environ.get(MODULES_ENV, "").split(","))):
        importlib.import_module(module)

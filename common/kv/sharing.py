"""The exporter's side of the KV data plane: which backends a worker offers, and its cache shares.

One KvCacheExporter per prefill worker, made once its engine has loaded. It names the cache
allocation (`kv_cache_id`, new on every start), puts the offer into every KvSessionRef's
attributes, and answers TensorStore.OpenKvCache with a CUDA IPC handle or a NIXL agent's metadata,
each made once and reused for every importer. Where it offers `cuda_ipc` it also keeps the fence of
one-sided reads (common.kv.fence): a table of block epochs the engine bumps, named in the attributes.
"""
from __future__ import annotations

import logging
import threading
import uuid
from typing import Callable

import torch

from common.kv import cuda_ipc, fence, shm
from common.kv.backends import (BACKENDS, KV_CACHE_ID_ATTRIBUTE, OFFERED_ATTRIBUTE, BackendUnavailable,
                                name_of)
from common.kv.chunks import dtype_name
from common.kv.layout import KvLayout
from common.kv.probe import PROBE_BLOCKS
from common.pb.disagg.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)


def nixl_unavailable_reason() -> str | None:
    try:
        from common.kv import nixl_plane
    except ImportError as exc:
        return f"NIXL support cannot be imported ({exc})"
    return nixl_plane.nixl_unavailable_reason()


def _unavailable_reason(backend: str, kv_cache: torch.Tensor) -> str | None:
    if backend == "cuda_ipc":
        return None if kv_cache.device.type == "cuda" else "the KV cache is in host memory"
    if backend == "nixl":
        return nixl_unavailable_reason()
    if backend == "shm":
        return None if shm.host_id() else "no /dev/shm or host id here"
    return None


class KvCacheExporter:
    def __init__(self, kv_cache: torch.Tensor, allowed: tuple[str, ...], worker_id: str = "",
                 count_reuse: Callable[[fence.BlockEpochs | None], None] | None = None):
        self.kv_cache = kv_cache
        self.kv_cache_id = f"{worker_id or 'kv'}-{uuid.uuid4().hex[:12]}"
        self.offered: list[str] = []
        for backend in allowed:
            reason = _unavailable_reason(backend, kv_cache)
            if reason is None:
                self.offered.append(backend)
            elif backend != "grpc":
                log.info("KV transfer backend %s not offered: %s", backend, reason)
        if "grpc" not in self.offered:
            self.offered.append("grpc")
        self._attributes = {OFFERED_ATTRIBUTE: ",".join(self.offered), KV_CACHE_ID_ATTRIBUTE: self.kv_cache_id}
        if shm.host_id():
            self._attributes[shm.HOST_ID_ATTRIBUTE] = shm.host_id()
        if kv_cache.device.type == "cuda":
            self._attributes[cuda_ipc.DEVICE_UUID_ATTRIBUTE] = cuda_ipc.device_uuid(kv_cache.device)
        self._shares: dict[int, worker_pb2.KvCacheShare] = {}
        self._nixl = None
        self._probe: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._count_reuse, self.epochs = count_reuse, None
        if count_reuse is not None and "cuda_ipc" in self.offered:
            self.epochs = fence.BlockEpochs.create(kv_cache.shape[2])
            count_reuse(self.epochs)
            self._attributes[fence.EPOCHS_ATTRIBUTE] = str(self.epochs.path)
        log.info("KV transfer backends offered: %s (cache %s)", ",".join(self.offered), self.kv_cache_id)

    @property
    def best_backend(self) -> int:
        return BACKENDS[self.offered[0]]

    def attributes(self) -> dict[str, str]:
        """What every KvSessionRef of this worker carries: the offer, the cache id, host and GPU ids."""
        return dict(self._attributes)

    def share(self, backend: int) -> worker_pb2.KvCacheShare:
        """The cache shared for a one-sided backend (made once); BackendUnavailable with the reason otherwise."""
        name = name_of(backend)
        if name not in ("cuda_ipc", "nixl"):
            raise BackendUnavailable(f"OpenKvCache shares the cache for cuda_ipc or nixl, not {name}")
        if name not in self.offered:
            raise BackendUnavailable(f"this worker does not offer {name}: "
                                     f"{_unavailable_reason(name, self.kv_cache) or 'not in --kv-transfer-backends'}")
        with self._lock:
            if backend not in self._shares:
                self._shares[backend] = (cuda_ipc.share_cache(self.kv_cache, self.kv_cache_id) if name == "cuda_ipc"
                                         else self._share_nixl())
            return self._shares[backend]

    def probe_blocks(self, layout: KvLayout) -> torch.Tensor:
        """Blocks of zeros on the cache's device that importers' self-checks pull (common.kv.probe), made once."""
        with self._lock:
            if self._probe is None:
                self._probe = torch.zeros(layout.block_shape(PROBE_BLOCKS), dtype=self.kv_cache.dtype,
                                          device=self.kv_cache.device)
            return self._probe

    def _share_nixl(self) -> worker_pb2.KvCacheShare:
        from common.kv import nixl_plane

        self._nixl = nixl_plane.NixlExporter(self.kv_cache)
        share = worker_pb2.NixlShare(**self._nixl.info().to_fields())
        return worker_pb2.KvCacheShare(backend=common_pb2.TRANSFER_BACKEND_NIXL, kv_cache_id=self.kv_cache_id,
                                       shape=list(self.kv_cache.shape), dtype=dtype_name(self.kv_cache.dtype),
                                       nixl=share)

    def close(self) -> None:
        if self.epochs is not None:
            self._count_reuse(None)  # the engine stops writing the table before it goes
            self.epochs.close()
            self.epochs = None
        if self._nixl is not None:
            self._nixl.close()
            self._nixl = None

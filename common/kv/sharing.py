"""The exporter's side of the KV data plane: which transports a worker offers, and its cache shares.

One KvCacheExporter per prefill worker, made once its engine has loaded. It names the cache
allocation (`kv_cache_id`, new on every start), puts the offer into every KvSessionRef's
attributes, and answers TensorStore.OpenKvCache with the share of the transport asked for (a CUDA IPC
handle, a NIXL agent's metadata), each made once and reused for every importer. Where it offers a transport
whose reads are fenced (cuda_ipc) it also keeps the fence of one-sided reads (common.kv.fence): a table of
block epochs the engine bumps, named in the attributes.
"""
from __future__ import annotations

import logging
import threading
import uuid
from typing import Callable

import torch

from common.kv import fence, host, transport
from common.kv.errors import TransportUnavailable
from common.kv.layout import KvLayout
from common.kv.offer import KV_CACHE_ID_ATTRIBUTE, OFFERED_ATTRIBUTE
from common.kv.probe import PROBE_BLOCKS
from common.kv.shards import KvShards
from common.pb.disagg.v1 import worker_pb2

log = logging.getLogger(__name__)


def _unavailable_reason(candidate: transport.KvTransport, kv_cache: torch.Tensor | KvShards) -> str | None:
    if isinstance(kv_cache, KvShards) and not candidate.reads_sharded_caches:
        return f"it cannot export a tensor-parallel cache on {len(kv_cache.shards)} GPUs"
    return candidate.unavailable_reason(kv_cache.device)


def _offerable(allowed: tuple[str, ...], kv_cache: torch.Tensor | KvShards) -> dict[str, transport.KvTransport]:
    offered = {}
    for name in allowed:
        candidate = transport.create(name)
        reason = _unavailable_reason(candidate, kv_cache)
        if reason is None:
            offered[name] = candidate
        elif name != transport.FALLBACK:
            log.info("KV transport %s not offered: %s", name, reason)
    offered.setdefault(transport.FALLBACK, transport.create(transport.FALLBACK))
    return offered


class KvCacheExporter:
    def __init__(self, kv_cache: torch.Tensor | KvShards, allowed: tuple[str, ...], worker_id: str = "",
                 count_reuse: Callable[[fence.BlockEpochs | None], None] | None = None):
        self.kv_cache = kv_cache
        self.kv_cache_id = f"{worker_id or 'kv'}-{uuid.uuid4().hex[:12]}"
        self.transports = _offerable(allowed, kv_cache)
        self.offered: list[str] = list(self.transports)
        self._attributes = {OFFERED_ATTRIBUTE: ",".join(self.offered), KV_CACHE_ID_ATTRIBUTE: self.kv_cache_id}
        if host.host_id():
            self._attributes[host.HOST_ID_ATTRIBUTE] = host.host_id()
        for one in self.transports.values():
            self._attributes.update(one.offer(kv_cache))
        self._shares: dict[str, worker_pb2.KvCacheShare] = {}
        self._probe: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._count_reuse, self.epochs = count_reuse, None
        if count_reuse is not None and any(t.fences_reads for t in self.transports.values()):
            self.epochs = fence.BlockEpochs.create(kv_cache.shape[2])
            count_reuse(self.epochs)
            self._attributes[fence.EPOCHS_ATTRIBUTE] = str(self.epochs.path)
        log.info("KV transports offered: %s (cache %s)", ",".join(self.offered), self.kv_cache_id)

    @property
    def best_transport(self) -> int:
        """The TransferBackend a ref names its best transport by (UNSPECIFIED for one the enum lacks)."""
        return transport.number_of(self.offered[0])

    def attributes(self) -> dict[str, str]:
        """What every KvSessionRef of this worker carries: the offer, the cache id, host and GPU ids."""
        return dict(self._attributes)

    def share(self, name: str) -> worker_pb2.KvCacheShare:
        """The cache shared through a one-sided transport (made once); TransportUnavailable with the reason otherwise."""
        if name not in self.transports:
            reason = (_unavailable_reason(transport.create(name), self.kv_cache) if name in transport.names()
                      else "no such transport")
            raise TransportUnavailable(f"this worker does not offer {name}: {reason or 'not in --kv-transports'}")
        with self._lock:
            if name not in self._shares:
                self._shares[name] = self.transports[name].share(self.kv_cache, self.kv_cache_id)
            return self._shares[name]

    def probe_blocks(self, layout: KvLayout) -> torch.Tensor:
        """Blocks of zeros on the cache's device that importers' self-checks pull (common.kv.probe), made once."""
        with self._lock:
            if self._probe is None:
                self._probe = torch.zeros(layout.block_shape(PROBE_BLOCKS), dtype=self.kv_cache.dtype,
                                          device=self.kv_cache.device)
            return self._probe

    def close(self) -> None:
        if self.epochs is not None:
            self._count_reuse(None)  # the engine stops writing the table before it goes
            self.epochs.close()
            self.epochs = None
        for one in self.transports.values():
            one.close()

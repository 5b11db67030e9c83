"""The importer's mappings of exporters' caches: each exporter's whole cache mapped once per `kv_cache_id`
(common.kv.ipc_share), with its table of block epochs where this process can map it (common.kv.fence)."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from common.kv.fence import BlockEpochs, open_peer_table
from common.kv.ipc_share import open_cache
from common.kv.shards import KvShards
from common.kv.transports.cuda_ipc.block_copy import BlockCopier
from common.pb.disagg.v1 import worker_pb2

log = logging.getLogger(__name__)


@dataclass
class MappedCache:
    kv_cache_id: str
    tensor: torch.Tensor | KvShards
    epochs: BlockEpochs | None  # the exporter's fence of one-sided reads, where this process can map it
    copier: BlockCopier | None = None  # into this engine's cache (direct.py), made at the first import

    def close(self) -> None:
        if self.epochs is not None:
            self.epochs.close()


class CudaIpcMappings:
    """The exporters' caches this importer has mapped, one per exporter endpoint, re-mapped when the
    exporter's cache changes (a restarted worker), each with the exporter's epoch table when it has one."""

    def __init__(self) -> None:
        self._mapped: dict[str, MappedCache] = {}
        self._lock = threading.Lock()

    def get(self, endpoint: str, kv_cache_id: str) -> MappedCache | None:
        with self._lock:
            mapped = self._mapped.get(endpoint)
        return mapped if mapped is not None and mapped.kv_cache_id == kv_cache_id else None

    def put(self, endpoint: str, share: worker_pb2.KvCacheShare, epochs_path: str = "") -> MappedCache:
        tensor = open_cache(share)
        mapped = MappedCache(share.kv_cache_id, tensor, open_peer_table(epochs_path, tensor.shape[2], endpoint))
        with self._lock:
            old, self._mapped[endpoint] = self._mapped.get(endpoint), mapped
        if old is not None:
            old.close()
        log.info("mapped the KV cache %s of %s through CUDA IPC (%s %s, %.1f GB)%s", share.kv_cache_id, endpoint,
                 list(share.shape), share.dtype, tensor.numel() * tensor.element_size() / 1e9,
                 ", fenced by its block epochs" if mapped.epochs is not None else "")
        return mapped

    def close(self) -> None:
        with self._lock:
            mapped, self._mapped = list(self._mapped.values()), {}
        for one in mapped:
            one.close()

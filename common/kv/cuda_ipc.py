"""The `cuda_ipc` KV backend: same host, GPU memory read GPU-side by the importer, no host copy.

The exporter shares its whole KV cache tensor once per importer with torch's CUDA IPC sharing
(the storage's cudaIpcMemHandle, its offset, and torch's IPC reference counter); the importer maps
it once per exporter cache (`kv_cache_id`) and gathers each session's blocks on its own side stream
straight from the exporter's memory into its own GPU memory (a peer copy when the caches live on
two GPUs of the host), or, on one GPU, straight into blocks of its own cache (common.kv.direct), fenced
by the exporter's block epochs (common.kv.fence) so the session's Release leaves the critical path. Without
the fence, the Release's `released = true` is what proves the exporter held the blocks throughout the read.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from common.kv.block_copy import BlockCopier
from common.kv.fence import BlockEpochs, open_peer_table
from common.kv.ipc_share import open_cache
from common.kv.shards import KvShards
from common.pb.disagg.v1 import worker_pb2

log = logging.getLogger(__name__)
DEVICE_UUID_ATTRIBUTE = "cuda_device_uuid"


@dataclass
class MappedCache:
    kv_cache_id: str
    tensor: torch.Tensor | KvShards
    epochs: BlockEpochs | None  # the exporter's fence of one-sided reads, where this process can map it
    copier: BlockCopier | None = None  # into this engine's cache (common.kv.direct), made at the first import

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

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
from functools import lru_cache

import torch
from torch.multiprocessing.reductions import reduce_tensor, rebuild_cuda_tensor

from common.kv.backends import BackendUnavailable
from common.kv.block_copy import BlockCopier
from common.kv.chunks import dtype_name, torch_dtype
from common.kv.fence import BlockEpochs, open_peer_table
from common.kv.shards import KvShards
from common.pb.disagg.v1 import worker_pb2

log = logging.getLogger(__name__)
DEVICE_UUID_ATTRIBUTE = "cuda_device_uuid"


class CudaIpcUnavailable(BackendUnavailable):
    """This pair of processes cannot share GPU memory (no GPU, another host or container, no peer access)."""


def device_uuid(device: torch.device) -> str:
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


@lru_cache(maxsize=1)
def _visible_uuids() -> dict[str, int]:
    if not torch.cuda.is_available():
        return {}
    return {device_uuid(torch.device("cuda", i)): i for i in range(torch.cuda.device_count())}


def local_index_of(uuid: str) -> int | None:
    """This process's index of the GPU with `uuid` (CUDA_VISIBLE_DEVICES may number it differently), or None."""
    return _visible_uuids().get(uuid)


def share_cache(kv_cache: torch.Tensor | KvShards, kv_cache_id: str) -> worker_pb2.KvCacheShare:
    """The exporter's side: a CUDA IPC handle of the whole cache (of each rank's, for a tensor-parallel one),
    valid while this process keeps it."""
    if kv_cache.device.type != "cuda":
        raise CudaIpcUnavailable("this worker's KV cache is in host memory; cuda_ipc needs it on a GPU")
    if isinstance(kv_cache, KvShards):  # each rank's own share: a mapped shard cannot be shared again
        shards = [worker_pb2.CudaIpcShare.FromString(owned or share_cache(shard, kv_cache_id).payload)
                  for shard, owned in zip(kv_cache.shards, kv_cache.owner_shares)]
        return worker_pb2.KvCacheShare(transport="cuda_ipc", kv_cache_id=kv_cache_id, shape=list(kv_cache.shape),
                                       dtype=dtype_name(kv_cache.dtype),
                                       payload=worker_pb2.CudaIpcShare(head_shards=shards).SerializeToString())
    _, args = reduce_tensor(kv_cache)
    (_cls, size, stride, tensor_offset, _storage_cls, dtype, _device, handle, storage_size_bytes,
     storage_offset_bytes, _requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = args
    share = worker_pb2.CudaIpcShare(
        device_uuid=device_uuid(kv_cache.device), ipc_handle=handle, storage_size_bytes=storage_size_bytes,
        storage_offset_bytes=storage_offset_bytes, ref_counter_handle=ref_counter_handle,
        ref_counter_offset=ref_counter_offset, event_handle=event_handle or b"",
        event_sync_required=bool(event_sync_required), stride=list(stride), tensor_offset=tensor_offset,
    )
    return worker_pb2.KvCacheShare(transport="cuda_ipc", kv_cache_id=kv_cache_id, shape=list(size),
                                   dtype=dtype_name(dtype), payload=share.SerializeToString())


def open_cache(share: worker_pb2.KvCacheShare) -> torch.Tensor | KvShards:
    """The importer's side: the exporter's cache tensor (or its ranks' shards), mapped into this process (no copy)."""
    ipc = worker_pb2.CudaIpcShare.FromString(share.payload)
    if ipc.head_shards:
        n = len(ipc.head_shards)
        shape = list(share.shape)
        if shape[4] % n:
            raise CudaIpcUnavailable(f"the exporter's {shape[4]} KV heads do not split over its {n} shards")
        shape[4] //= n
        return KvShards([_open(ipc_shard, shape, share.dtype) for ipc_shard in ipc.head_shards])
    return _open(ipc, list(share.shape), share.dtype)


def _open(ipc: worker_pb2.CudaIpcShare, shape: list[int], dtype: str) -> torch.Tensor:
    index = local_index_of(ipc.device_uuid)
    if index is None:
        raise CudaIpcUnavailable(f"the exporter's GPU {ipc.device_uuid} is not visible to this process")
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(shape), tuple(ipc.stride), ipc.tensor_offset, torch.storage.TypedStorage,
            torch_dtype(dtype), index, ipc.ipc_handle, ipc.storage_size_bytes, ipc.storage_offset_bytes, False,
            ipc.ref_counter_handle, ipc.ref_counter_offset, ipc.event_handle or None, ipc.event_sync_required,
        )
    except (RuntimeError, OSError) as exc:  # e.g. another container's IPC namespace, or /dev/shm not shared
        raise CudaIpcUnavailable(f"cannot map the exporter's KV cache: {str(exc).splitlines()[0]}") from None


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

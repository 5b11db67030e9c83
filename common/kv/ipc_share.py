"""A KV cache shared with another process of this host through CUDA IPC: the storage's cudaIpcMemHandle, its offset
and torch's IPC reference counter, mapped on the other side without a copy. A tensor-parallel engine's ranks share
their caches this way at their rendezvous (common.engine.model_runner: rank 0 sees them as KvShards), and the
`cuda_ipc` transport's exporter shares its whole cache with importers (common.kv.transports.cuda_ipc)."""
from __future__ import annotations

from functools import lru_cache

import torch
from torch.multiprocessing.reductions import reduce_tensor, rebuild_cuda_tensor

from common.kv.chunks import dtype_name, torch_dtype
from common.kv.errors import TransportUnavailable
from common.kv.shards import KvShards
from common.pb.disagg.v1 import worker_pb2


class CudaIpcUnavailable(TransportUnavailable):
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

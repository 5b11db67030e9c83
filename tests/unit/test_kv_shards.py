"""A tensor-parallel engine's cache on several GPUs, as the KV data plane sees it (common.kv.shards): the blocks
read from its shards are the whole cache's, every head in order, and blocks written land in the right shard's
heads. CPU tensors stand in for the GPUs here; tests/gpu/test_tensor_parallel_gpu.py runs it across two."""
from types import SimpleNamespace

import pytest
import torch

from common.kv.ipc_share import CudaIpcUnavailable, share_cache
from common.kv.transports.cuda_ipc.direct import can_place
from common.kv.blocks import gather_blocks
from common.kv.shards import KvShards

SHAPE = (3, 2, 10, 4, 6, 5)  # layers, K/V, blocks, block size, 6 KV heads, head dim


def _split(whole: torch.Tensor, n: int) -> KvShards:
    return KvShards([part.contiguous() for part in whole.chunk(n, dim=4)])


@pytest.mark.parametrize("n", [1, 2, 3])
def test_blocks_gathered_from_the_shards_are_the_whole_caches(n):
    whole = torch.randn(SHAPE)
    shards = _split(whole, n)
    assert shards.shape == whole.shape and shards.numel() == whole.numel()
    ids = [7, 2, 3, 9]
    assert torch.equal(gather_blocks(shards, ids), whole[:, :, ids])


def test_blocks_scattered_land_in_each_shards_own_heads():
    whole, blocks = torch.zeros(SHAPE), torch.randn(3, 2, 2, 4, 6, 5)
    shards = _split(whole, 3)
    shards.scatter([5, 1], blocks)
    whole[:, :, [5, 1]] = blocks
    assert torch.equal(torch.cat(shards.shards, dim=4), whole)


def test_shards_that_differ_are_refused():
    with pytest.raises(ValueError, match="differ"):
        KvShards([torch.zeros(SHAPE), torch.zeros(SHAPE, dtype=torch.float16)])


def test_a_sharded_cache_is_never_a_direct_copys_target_or_source():
    """The direct import copies whole blocks between two caches of one GPU; a sharded one's blocks are scattered by
    its engine, so the importer gathers instead."""

    sharded, whole = SimpleNamespace(cache=_split(torch.zeros(SHAPE), 2)), SimpleNamespace(cache=torch.zeros(SHAPE))
    assert not can_place(torch.zeros(SHAPE), sharded)
    assert can_place(torch.zeros(SHAPE), whole) and not can_place(_split(torch.zeros(SHAPE), 2), whole)


def test_a_sharded_cache_in_host_memory_is_not_shared_through_cuda_ipc():
    with pytest.raises(CudaIpcUnavailable, match="host memory"):
        share_cache(_split(torch.zeros(SHAPE), 2), "kv-1")

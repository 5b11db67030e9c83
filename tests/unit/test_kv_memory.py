"""The KV cache sized from a worker's share of the GPU and its own use of it (common/engine/kv_memory.py), never from
what other processes on the device hold; a block count where no share applies."""

import pytest

from common.engine.config import CPU_KV_BLOCKS, DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig, kv_cache_blocks
from common.engine.kv_memory import DeviceMemory, kv_blocks_for_share
from common.errors import InvalidConfig

GIB = 1 << 30
BLOCK = 2 << 20  # bytes of one KV block


def test_blocks_fill_the_share_less_this_worker_s_own_weights_context_and_step():
    memory = DeviceMemory(total=80 * GIB, free=78 * GIB, torch_reserved=2 * GIB, non_torch=GIB // 2)
    blocks, line = kv_blocks_for_share(0.9, memory, BLOCK, reserve_bytes=GIB)
    assert blocks == (int(80 * GIB * 0.9) - 2 * GIB - GIB // 2 - GIB) // BLOCK
    assert line.startswith(f"KV cache: {blocks} blocks") and "capped" not in line


def _worker_on_a_shared_gpu(device_used_by_others: int, weights: int, share: float) -> tuple[int, int]:
    """One worker's sizing on a 140 GiB GPU where others already hold `device_used_by_others`: its blocks, and what
    it then holds in all (weights, context, the cache)."""
    context = GIB // 2
    memory = DeviceMemory(total=140 * GIB, free=140 * GIB - device_used_by_others - weights - context,
                          torch_reserved=weights, non_torch=context)
    blocks, _ = kv_blocks_for_share(share, memory, BLOCK, reserve_bytes=3 * GIB)
    return blocks, weights + context + blocks * BLOCK


@pytest.mark.parametrize("weights", [(6 * GIB, 6 * GIB), (6 * GIB, 16 * GIB)])
def test_two_workers_on_one_gpu_get_the_same_pools_whichever_sizes_first(weights):
    """`up`'s one-GPU layout: prefill and decode each at 0.45. The second counts only its own memory, so the first's
    KV cache does not shrink it; the order changes nothing."""
    a_first, a_held = _worker_on_a_shared_gpu(0, weights[0], 0.45)
    b_second, _ = _worker_on_a_shared_gpu(a_held, weights[1], 0.45)
    b_first, b_held = _worker_on_a_shared_gpu(0, weights[1], 0.45)
    a_second, _ = _worker_on_a_shared_gpu(b_held, weights[0], 0.45)
    assert (a_first, b_second) == (a_second, b_first)
    if weights[0] == weights[1]:
        assert abs(a_first - b_second) <= 0.02 * a_first


def test_memory_another_process_holds_caps_the_cache_and_says_so():
    memory = DeviceMemory(total=80 * GIB, free=20 * GIB, torch_reserved=2 * GIB, non_torch=GIB // 2)
    blocks, line = kv_blocks_for_share(0.9, memory, BLOCK, reserve_bytes=GIB)
    assert blocks == (20 * GIB - GIB - GIB) // BLOCK  # free less the step and the margin
    assert "capped by the device's free memory (20.0 GiB)" in line


def test_no_room_for_one_block_names_the_flag_and_what_took_the_room():
    memory = DeviceMemory(total=80 * GIB, free=70 * GIB, torch_reserved=9 * GIB, non_torch=0)
    with pytest.raises(InvalidConfig, match=r"--gpu-memory-utilization 0.1: of 80.0 GiB this worker's share is 8.0; "
                                            r"its weights and context take 9.0"):
        kv_blocks_for_share(0.1, memory, 1 << 20, reserve_bytes=0)


def test_the_default_sizing_by_device_and_the_line_where_both_flags_are_given():
    assert EngineConfig(model="m").memory_share is None
    assert kv_cache_blocks(EngineConfig(model="m"), None, BLOCK) == CPU_KV_BLOCKS
    assert kv_cache_blocks(EngineConfig(model="m", num_kv_blocks=7), None, BLOCK) == 7
    assert EngineConfig(model="m", device="cuda").memory_share == DEFAULT_GPU_MEMORY_UTILIZATION
    assert EngineConfig(model="m", device="cuda", num_kv_blocks=64).memory_share is None
    both = EngineConfig(model="m", device="cuda", num_kv_blocks=64, gpu_memory_utilization=0.5)
    assert both.memory_share == 0.5
    assert both.kv_sizing() == "KV cache sized by --gpu-memory-utilization 0.5; --num-kv-blocks 64 does not apply"


@pytest.mark.parametrize("changes, match", [
    (dict(gpu_memory_utilization=0.0, device="cuda"), r"must be in \(0, 1\]"),
    (dict(gpu_memory_utilization=1.5, device="cuda"), r"must be in \(0, 1\]"),
    (dict(gpu_memory_utilization=0.9), "on a CUDA device; --device is 'cpu'"),
    (dict(num_kv_blocks=0), "num_kv_blocks must be >= 1"),
])
def test_bad_values_are_refused(changes, match):
    with pytest.raises(InvalidConfig, match=match):
        EngineConfig(model="m", **changes)

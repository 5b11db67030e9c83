"""--gpu-memory-utilization: the KV cache is sized from what the GPU has left after the weights."""
import pytest

from common.engine.config import EngineConfig, kv_blocks_for_memory
from common.errors import InvalidConfig

GIB = 1 << 30


def test_blocks_fill_the_fraction_left_after_weights_and_the_step_reserve():
    # 80 GiB device, 2 GiB already used (weights), 0.9 of it for us, 1 GiB reserve, 2 MiB blocks
    blocks = kv_blocks_for_memory(0.9, free_bytes=78 * GIB, total_bytes=80 * GIB, block_bytes=2 << 20,
                                  reserve_bytes=GIB)
    assert blocks == (int(80 * GIB * 0.9) - 2 * GIB - GIB) // (2 << 20)


def test_no_room_for_one_block_names_the_flag():
    with pytest.raises(InvalidConfig, match="--gpu-memory-utilization 0.1: .* leaves no room for a KV block"):
        kv_blocks_for_memory(0.1, free_bytes=70 * GIB, total_bytes=80 * GIB, block_bytes=1 << 20, reserve_bytes=0)


@pytest.mark.parametrize("changes, match", [
    (dict(gpu_memory_utilization=0.0, device="cuda"), r"must be in \(0, 1\]"),
    (dict(gpu_memory_utilization=1.5, device="cuda"), r"must be in \(0, 1\]"),
    (dict(gpu_memory_utilization=0.9), "on a CUDA device; --device is 'cpu'"),
])
def test_bad_utilization_is_refused(changes, match):
    with pytest.raises(InvalidConfig, match=match):
        EngineConfig(model="m", **changes)

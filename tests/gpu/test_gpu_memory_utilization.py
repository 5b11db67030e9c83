"""--gpu-memory-utilization on a real GPU: the KV pool fills the fraction left after the weights, the engine's
block manager gets that many blocks, and generation still matches the same engine sized by block count."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import LLMEngine  # noqa: E402
from common.engine.request import SamplingParams  # noqa: E402
from tests.tiny_models import TINY_FAMILIES, make_tiny_model  # noqa: E402


def _generate(engine: LLMEngine) -> list[int]:
    engine.add_request("r", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_kv_pool_fills_the_memory_fraction_left_after_the_weights(tmp_path):
    model = str(make_tiny_model(tmp_path / "tiny", next(iter(TINY_FAMILIES))))
    utilization = 0.3
    engine = LLMEngine(EngineConfig(model=model, device="cuda", gpu_memory_utilization=utilization, enforce_eager=True))
    runner = engine.runner
    free, total = torch.cuda.mem_get_info()
    assert engine.block_manager.num_blocks == runner.num_kv_blocks == runner.kv_cache.shape[2]
    assert runner.num_kv_blocks > 1024  # far more than the default block count on a tiny model
    used = total - free
    print(f"gpu {total / 2**30:.1f} GiB, used after the KV pool {used / 2**30:.2f} GiB "
          f"({used / total:.3f}), {runner.num_kv_blocks} blocks")
    assert utilization - 0.05 < used / total <= utilization + 0.01
    counted = LLMEngine(EngineConfig(model=model, device="cuda", num_kv_blocks=256, enforce_eager=True))
    assert _generate(engine) == _generate(counted)

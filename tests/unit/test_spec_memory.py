"""A speculative proposer's device memory counted before it loads (common/engine/spec/memory.py) is what the loaded
proposer holds: a draft model's weights and KV a block, an EAGLE-3 head's; and a target sized from its share of a
GPU (config.kv_blocks_in_share) leaves room for them, where before the draft's pool of the target's block count came
on top of a full share (an 8B target with a 1B draft ran out of memory on an H200)."""
from __future__ import annotations

import json

import pytest
import torch

from common.engine.config import EngineConfig, kv_blocks_in_share
from common.engine.engine import LLMEngine
from common.engine.kv_memory import DeviceMemory
from common.engine.models.checkpoint import load_config
from common.engine.spec.config import parse_speculative_config
from common.engine.spec.memory import NOTHING, proposer_memory
from tests.unit.test_spec_draft import _draft_dir
from tests.unit.test_spec_eagle3 import _target, head_tensors, save_head

GIB = 1 << 30


def _spec(method: str, model: str, k: int = 3):
    return parse_speculative_config(json.dumps({"method": method, "model": model, "num_speculative_tokens": k}))


def _held(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters, each storage once (a tied embedding is one)."""
    return sum({p.untyped_storage().data_ptr(): p.nbytes for p in module.parameters()}.values())


def _predicted(engine: LLMEngine):
    config = engine.config
    return proposer_memory(config.speculative_config, engine.runner.hf_config.hidden_size, engine.runner.dtype,
                           config.block_size, config.max_num_seqs)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return _target(tmp_path_factory.mktemp("memory-target"))


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> str:
    return _draft_dir(tmp_path_factory.mktemp("memory-draft"), layers=2)


def test_a_draft_models_weights_and_kv_are_counted_as_the_loaded_draft_holds_them(target, draft):
    engine = LLMEngine(EngineConfig(model=target, block_size=4, num_kv_blocks=64,
                                    speculative_config=_spec("draft", draft)))
    drafted = engine.speculator.proposer.engine
    predicted = _predicted(engine)
    assert predicted.weight_bytes == _held(drafted.runner.model)
    assert predicted.block_bytes == drafted.runner.kv_cache.nbytes // drafted.block_manager.num_blocks
    assert predicted.extra_blocks == drafted.block_manager.num_blocks - engine.block_manager.num_blocks


def test_an_eagle3_heads_weights_and_kv_are_counted_as_the_loaded_head_holds_them(target, tmp_path):
    head = save_head(tmp_path / "head", head_tensors())
    engine = LLMEngine(EngineConfig(model=target, block_size=4, num_kv_blocks=64,
                                    speculative_config=_spec("eagle3", head)))
    proposer = engine.speculator.proposer
    predicted = _predicted(engine)
    assert predicted.weight_bytes == _held(proposer.head)
    assert predicted.block_bytes == proposer.kv.nbytes // proposer.blocks.num_blocks
    assert predicted.extra_blocks == proposer.blocks.num_blocks - engine.block_manager.num_blocks


def test_ngram_and_no_speculation_hold_nothing_on_the_device():
    ngram = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert proposer_memory(ngram, 64, torch.float32, 16, 8) == NOTHING
    assert proposer_memory(None, 64, torch.float32, 16, 8) == NOTHING


def test_a_target_sized_from_its_gpu_share_leaves_room_for_its_draft(target, draft):
    """The same share, the same device: with a draft the target takes fewer blocks, and its blocks, the draft's beside
    each and the draft's weights together stay inside what the share leaves after the step's reserve."""
    memory = DeviceMemory(total=8 * GIB, free=8 * GIB, torch_reserved=GIB // 2, non_torch=GIB // 4)
    hf = load_config(target)
    block_bytes = 2 * hf.num_hidden_layers * 16 * hf.num_key_value_heads * (hf.hidden_size // hf.num_attention_heads) * 2

    def sized(spec):
        config = EngineConfig(model=target, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5,
                              speculative_config=spec)
        proposer = proposer_memory(spec, hf.hidden_size, torch.bfloat16, 16, config.max_num_seqs)
        return config, kv_blocks_in_share(config, hf, block_bytes, memory, proposer)

    _, (alone, _) = sized(None)
    config, (with_draft, line) = sized(_spec("draft", draft))
    proposer = proposer_memory(config.speculative_config, hf.hidden_size, torch.bfloat16, 16, config.max_num_seqs)
    assert proposer.weight_bytes > 0 and proposer.block_bytes > 0
    assert with_draft < alone
    room = 0.5 * memory.total - memory.torch_reserved - memory.non_torch
    assert with_draft * (block_bytes + proposer.block_bytes) + proposer.fixed_bytes <= room
    # the same budget is spent, to within a block: the target alone would have taken all of it as its own blocks
    spent = with_draft * (block_bytes + proposer.block_bytes) + proposer.fixed_bytes
    assert abs(alone * block_bytes - spent) <= block_bytes + proposer.block_bytes
    assert "draft proposer" in line

"""--load-format dummy: any registered family from its config.json alone, random weights made on the device (no
safetensors file read), the same seed giving the same model and tokens, and a sharded model the unsharded one's
slices."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.models.dummy import HIGH, dummy_state
from common.engine.models.loader import load_config, load_model
from common.engine.models.registry import MODELS, model_class
from common.engine.models.sharding import shard_state
from common.engine.parallel import SINGLE, TensorParallel
from common.engine.request import SamplingParams
from tests.tiny_models import _COMMON, TINY_FAMILIES

# Every tiny family the registry serves (a family registered later joins by itself).
FAMILIES = [f for f, (_, model_cls, _) in TINY_FAMILIES.items() if model_cls.__name__ in MODELS]


def config_dir(directory: Path, family: str) -> Path:
    """A model directory holding the family's config.json and nothing else."""
    config_cls, model_cls, extra = TINY_FAMILIES[family]
    config = config_cls(**_COMMON, **extra)
    config.architectures = [model_cls.__name__]
    config.save_pretrained(directory)
    return directory


def llava_config_dir(directory: Path) -> Path:
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8)
    config = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**_COMMON, num_key_value_heads=2),
                         image_token_index=500)
    config.architectures = ["LlavaForConditionalGeneration"]
    config.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("family", [*FAMILIES, "llava"])
def test_a_dummy_model_of_every_family_loads_from_its_config_alone(tmp_path, family):
    path = llava_config_dir(tmp_path) if family == "llava" else config_dir(tmp_path, family)
    assert [p.name for p in path.iterdir()] == ["config.json"]
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"), load_format="dummy", seed=3)
    config = load_config(path)
    with torch.device("meta"):
        declared = dict(model_class(config)(config, SINGLE).named_parameters())
    params = dict(model.named_parameters())
    assert {k: v.shape for k, v in params.items()} == {k: v.shape for k, v in declared.items()}
    for name, param in params.items():
        assert param.device.type == "cpu" and param.dtype == torch.bfloat16, name
        assert torch.isfinite(param).all() and param.abs().max() <= HIGH and param.float().std() > 0, name


def _greedy_tokens(path: Path, seed: int) -> tuple[list[int], torch.Tensor]:
    engine = LLMEngine(EngineConfig(model=str(path), load_format="dummy", dummy_seed=seed, block_size=4,
                                    num_kv_blocks=64))
    engine.add_request("r", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens, engine.runner.model.model.layers[0].self_attn.qkv_proj.weight.clone()


def test_a_dummy_model_generates_and_the_same_seed_gives_the_same_tokens(tmp_path):
    path = config_dir(tmp_path, "llama-gqa")
    tokens, weight = _greedy_tokens(path, seed=0)
    again, same = _greedy_tokens(path, seed=0)
    _, other = _greedy_tokens(path, seed=1)
    assert len(tokens) == 8 and tokens == again and torch.equal(weight, same)
    assert not torch.equal(weight, other)


@pytest.mark.parametrize("family", [f for f in ("llama-gqa", "qwen2-bias", "qwen3-moe", "mixtral") if f in FAMILIES])
def test_each_rank_makes_its_share_of_the_unsharded_dummy_model(tmp_path, family):
    config = load_config(config_dir(tmp_path, family))
    with torch.device("meta"):
        whole_model = model_class(config)(config, SINGLE)
    whole = dummy_state(whole_model, config, torch.float32, torch.device("cpu"), SINGLE, seed=5)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        with torch.device("meta"):
            model = model_class(config)(config, tp)
        shard = dummy_state(model, config, torch.float32, torch.device("cpu"), tp, seed=5)
        expected = shard_state(whole, model.tp_plan(), tp)
        assert shard.keys() == expected.keys() and all(torch.equal(shard[k], expected[k]) for k in shard)
        # each share in memory of its own: none keeps its whole tensor alive
        assert all(v.untyped_storage().nbytes() == v.nbytes for v in shard.values())
        assert {k: v.shape for k, v in shard.items()} == {
            k: v.shape for k, v in model.state_dict().items() if k not in model.tied_keys}

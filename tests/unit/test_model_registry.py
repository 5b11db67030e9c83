"""Model families come from the registry by their Hugging Face `architectures` name; Phi-3 came in that way alone."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.engine.models.checkpoint import load_config
from common.engine.models.contract import CausalLM
from common.engine.models.loader import load_model
from common.engine.models.registry import MODELS, architecture_of, model_class
from common.errors import InvalidConfig


def test_every_registered_family_is_a_model_class():
    for name in MODELS:
        cls = model_class(type("C", (), {"architectures": [name], "model_type": ""})())
        assert issubclass(cls, CausalLM) and not cls.__abstractmethods__, name
        assert callable(cls.forward) and callable(cls.kv_shape)


def test_an_unregistered_architecture_is_refused_by_name(tiny_llama):
    config = load_config(tiny_llama)
    config.architectures = ["GPTNeoXForCausalLM"]
    with pytest.raises(InvalidConfig, match="GPTNeoXForCausalLM"):
        architecture_of(config)


def test_phi3_loads_its_already_fused_projections_as_they_are(tiny_model_dirs):
    path = tiny_model_dirs["phi3"]
    ckpt = load_file(str(next(Path(path).glob("*.safetensors"))))
    assert "model.layers.0.self_attn.qkv_proj.weight" in ckpt and "model.layers.0.self_attn.q_proj.weight" not in ckpt
    model, config = load_model(path, torch.float32, torch.device("cpu"))
    assert type(model).__name__ == "Phi3ForCausalLM"
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight, ckpt["model.layers.1.mlp.gate_up_proj.weight"])
    shape = model.kv_shape()
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (2, 2, 16)


def test_phi3_with_partial_rotary_is_refused(tiny_model_dirs):
    config = load_config(tiny_model_dirs["phi3"])
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    with pytest.raises(InvalidConfig, match="partial rotary"):
        model_class(config)(config)

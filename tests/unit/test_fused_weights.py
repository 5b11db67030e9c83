"""Fused projections (qkv, gate_up) built at load time from the checkpoint's separate tensors, and the torch
reference of the fused kernels (what the GPU kernels are tested against) against the model's unfused math."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from common.engine.kernels import reference
from common.engine.models.llama import LlamaForCausalLM, RotaryEmbedding, apply_rope
from common.engine.models.loader import fuse_projections, load_config, load_model


def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    return load_file(str(next(Path(path).glob("*.safetensors"))))


def test_qkv_and_gate_up_hold_the_checkpoint_rows_in_order_with_biases(tiny_model_dirs):
    path = tiny_model_dirs["qwen2-bias"]
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    ckpt = _checkpoint(path)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        for param in ("weight", "bias"):
            expected = torch.cat([ckpt[f"{p}self_attn.{n}_proj.{param}"] for n in "qkv"])
            assert torch.equal(getattr(layer.self_attn.qkv_proj, param), expected)
        expected = torch.cat([ckpt[f"{p}mlp.gate_proj.weight"], ckpt[f"{p}mlp.up_proj.weight"]])
        assert torch.equal(layer.mlp.gate_up_proj.weight, expected)


def test_qwen3_keeps_its_q_and_k_norms_beside_the_fused_qkv(tiny_model_dirs):
    path = tiny_model_dirs["qwen3-qknorm"]
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    ckpt = _checkpoint(path)
    attn = model.model.layers[1].self_attn
    assert torch.equal(attn.q_norm.weight, ckpt["model.layers.1.self_attn.q_norm.weight"])
    assert torch.equal(attn.k_norm.weight, ckpt["model.layers.1.self_attn.k_norm.weight"])
    assert attn.qkv_proj.weight.shape[0] == (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim


def test_an_incomplete_projection_set_is_left_unfused_for_the_key_check():
    state = {"model.layers.0.self_attn.q_proj.weight": torch.ones(2, 2),
             "model.layers.0.self_attn.k_proj.weight": torch.ones(1, 2)}
    assert set(fuse_projections(state, LlamaForCausalLM.packed_modules_mapping)) == set(state)


def test_reference_rope_store_kv_matches_the_model_rope_and_a_plain_cache_write(tiny_model_dirs):
    config = load_config(tiny_model_dirs["llama-tied-rope-scaled"])  # llama3 rope scaling
    heads, kv_heads, dim = 4, 2, 16
    rotary = RotaryEmbedding(config, dim)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=g)
    positions = torch.tensor([0, 3, 9, 200, 511])
    slots = torch.tensor([7, -1, 0, 12, 3])
    k_cache, v_cache = torch.zeros(2, 4, 4, kv_heads, dim)  # [blocks, block_size, Hkv, D] each
    q = reference.rope_store_kv(qkv, positions, rotary.cos_sin_cache(torch.float32), k_cache, v_cache, slots,
                                heads, kv_heads, dim)
    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    cos, sin = rotary(positions, torch.float32)
    torch.testing.assert_close(q, apply_rope(q_ref.reshape(5, heads, dim), cos, sin))
    k_ref = apply_rope(k_ref.reshape(5, kv_heads, dim), cos, sin)
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat_k[slot], k_ref[row])
            torch.testing.assert_close(flat_v[slot], v_ref[row].reshape(kv_heads, dim))
    assert flat_k.abs().sum(dim=(1, 2)).count_nonzero() == 4  # the -1 row wrote nothing


def test_reference_add_rms_norm_rounds_the_residual_sum_to_the_dtype_first():
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(3, 32, generator=g).bfloat16(), torch.randn(3, 32, generator=g).bfloat16()
    w = torch.randn(32, generator=g).bfloat16()
    out, total = reference.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(total, x + r)
    assert torch.equal(out, reference.rms_norm(x + r, w, 1e-6))


def test_reference_silu_and_mul_splits_gate_then_up():
    x = torch.randn(2, 3, 8)
    gate, up = x[..., :4], x[..., 4:]
    torch.testing.assert_close(reference.silu_and_mul(x), torch.nn.functional.silu(gate) * up)

"""FP8 weights (Hugging Face's and llm-compressor's checkpoints, --quantization fp8) and the FP8 KV cache.

FP8 weights are checked both ways an engine holds them: as Fp8Linear layers (a GPU's way, forced on the CPU, where
they dequantise on every call) and dequantised once at load (the CPU's way).

Tolerances: against the unquantised float32 model, the relative RMS error of the prompt's logits, |a - b| / |a|,
stays under 0.25 with FP8 weights and under 0.2 with an FP8 KV cache. Measured on these tiny random models
(initializer_range 0.2, which amplifies a weight's error about sixfold by the logits): 0.10-0.15 with FP8 weights,
0.07-0.11 with the FP8 cache, 0.022 for plain bf16. A checkpoint's FP8 engine equals, exactly (float32), the same
engine on the checkpoint's weights dequantised by the format's own rule (transformers' Fp8Dequantize for HF).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize
from transformers.utils.quantization_config import FineGrainedFP8Config

from common.engine import cpu_attention
from common.engine.attention import BatchLayout, TorchPagedAttention
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.model_runner import ModelRunner, StepInputs
from common.engine.models.loader import load_model
from common.engine.parallel import TensorParallel
from common.engine.quantization import fp8_checkpoint
from common.engine.quantization.fp8_checkpoint import Fp8Weights
from common.engine.quantization.fp8_linear import Fp8Linear, dequantize, quantize_rows
from common.engine.quantization.kv_cache import KvCacheFormat
from common.engine.request import RequestType, SamplingParams
from common.errors import InvalidConfig, LayoutMismatch
from common.pb.disagg.v1 import common_pb2
from common.kv.chunks import tensor_from_bytes, tensor_to_bytes
from common.kv.layout import KvExport, layout_of
from common.kv.shards import KvShards
from common.kv.transports.cuda_ipc.block_copy import copy_blocks_reference
from common.kv.wire import session_ref

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = torch.randint(3, 256, (21,), generator=torch.Generator().manual_seed(0)).tolist()
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHT_TOLERANCE, KV_TOLERANCE = 0.25, 0.2


def _rel(reference: torch.Tensor, other: torch.Tensor) -> float:
    return ((reference - other).norm() / reference.norm()).item()


def _prompt_logits(model_dir, prompt=PROMPT, **config) -> torch.Tensor:
    """Every prompt position's logits, from one prefill step of our runner."""
    runner = ModelRunner(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=32, **config))
    n = len(prompt)
    layout = BatchLayout([n], [0], [list(range(-(-n // 4)))])
    return runner.run_step(StepInputs(prompt, list(range(n)), layout, list(range(n))))


def _engine(model_dir, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"block_size": 4, "num_kv_blocks": 64, **config}))


def _derived(source: Path, target: Path, state: dict[str, torch.Tensor], quantization: dict | None) -> Path:
    """`source`'s model directory with other weights and, when given, a quantization_config."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((target / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization is not None:
        config["quantization_config"] = quantization
    (target / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(target / "model.safetensors"))
    return target


def _checkpoint(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(next(Path(model_dir).glob("*.safetensors"))))


def _is_linear(key: str) -> bool:
    return key.endswith(".weight") and key.rpartition(".")[0].rpartition(".")[2] in LINEARS


def _hf_fp8(source: Path, target: Path, block: tuple[int, int]) -> tuple[Path, Path]:
    """(an FP8 checkpoint written by transformers' own FineGrainedFP8 quantiser, the same weights dequantised by
    transformers' Fp8Dequantize). Like transformers, it leaves shapes its blocks do not tile in their dtype."""
    config = FineGrainedFP8Config(weight_block_size=block)
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=config))
    fp8, plain = {}, {}
    for key, value in _checkpoint(source).items():
        written = quantize._quantize_one(key, value) if _is_linear(key) else {key: value}
        fp8.update(written)
        scale = written.get(key.removesuffix(".weight") + ".weight_scale_inv")
        plain[key] = value if scale is None else Fp8Dequantize(None)._dequantize_one(written[key], scale, torch.float32)
    assert any(v.dtype == FP8 for v in fp8.values())
    return (_derived(source, target / "fp8", fp8, config.to_dict()),
            _derived(source, target / "dequantised", plain, None))


def _compressed_tensors_fp8(source: Path, target: Path, strategy: str) -> tuple[Path, Path]:
    """(an FP8 checkpoint as llm-compressor writes it: weight, weight_scale ([1] per tensor, [out, 1] per channel),
    a static input_scale, calibrated k_scale / v_scale; the same weights dequantised: weight * weight_scale)."""
    fp8, plain = {}, {}
    for key, value in _checkpoint(source).items():
        if not _is_linear(key):
            fp8[key] = plain[key] = value
            continue
        module = key.removesuffix(".weight")
        amax = value.abs().amax() if strategy == "tensor" else value.abs().amax(dim=1, keepdim=True)
        scale = (amax / 448.0).reshape(1) if strategy == "tensor" else amax / 448.0
        fp8[key] = (value / scale).clamp(-448, 448).to(FP8)
        fp8[f"{module}.weight_scale"], fp8[f"{module}.input_scale"] = scale, torch.tensor([0.05])
        plain[key] = fp8[key].float() * scale
        if module.endswith("k_proj"):
            attention = module.removesuffix(".k_proj")
            fp8[f"{attention}.k_scale"], fp8[f"{attention}.v_scale"] = torch.tensor(0.1), torch.tensor(0.1)
    float_args = lambda strategy, dynamic: {"num_bits": 8, "type": "float", "strategy": strategy,  # noqa: E731
                                            "symmetric": True, "dynamic": dynamic}
    quantization = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": float_args(strategy, False),
                                      "input_activations": float_args("tensor", False)}},
        "kv_cache_scheme": float_args("tensor", False), "ignore": ["lm_head"]}
    return _derived(source, target / "fp8", fp8, quantization), _derived(source, target / "dequantised", plain, None)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> Path:
    """A tiny Llama whose q, o and MLP weights tile 128x128 blocks (DeepSeek's) and whose k / v (64 rows) do not."""
    path = tmp_path_factory.mktemp("wide-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.2, tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(params=["held as fp8", "dequantised at load"])
def held(request, monkeypatch) -> bool:
    """Both ways an engine holds FP8 weights: Fp8Linear layers (a GPU's way; here their dequantising path, forced)
    or plain ones dequantised once at load (the CPU's)."""
    keep = request.param == "held as fp8"
    monkeypatch.setattr(fp8_checkpoint, "holds_fp8", lambda device: keep)
    return keep


@pytest.mark.parametrize("fmt", ["hf-block-128", "hf-block-32", "compressed-tensors-channel",
                                 "compressed-tensors-tensor"])
def test_an_fp8_checkpoint_runs_as_its_dequantised_weights_and_near_the_original(fmt, held, wide_llama, tiny_llama,
                                                                                  tmp_path):
    if fmt == "hf-block-128":
        source = wide_llama
        fp8, dequantised = _hf_fp8(source, tmp_path, (128, 128))
    elif fmt == "hf-block-32":  # several blocks along both sides of every weight
        source = Path(tiny_llama)
        fp8, dequantised = _hf_fp8(source, tmp_path, (32, 32))
    else:
        source = Path(tiny_llama)
        fp8, dequantised = _compressed_tensors_fp8(source, tmp_path, fmt.rpartition("-")[2])
    model, _ = load_model(fp8, torch.float32, torch.device("cpu"))
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, Fp8Linear if held else nn.Linear)
    assert layer.mlp.gate_up_proj.weight.dtype == (FP8 if held else torch.float32)
    assert isinstance(model.lm_head, nn.Linear)  # lm_head stays unquantised in both formats
    # transformers left k / v (64 rows) unquantised: the fused q ‖ k ‖ v is one plain linear, q dequantised
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear if held and fmt != "hf-block-128" else nn.Linear)

    logits = _prompt_logits(fp8)
    assert torch.equal(logits, _prompt_logits(dequantised))
    assert _rel(_prompt_logits(source), logits) < WEIGHT_TOLERANCE
    assert _engine(fp8).generate([PROMPT], GREEDY) == _engine(dequantised).generate([PROMPT], GREEDY)
    # --quantization fp8 changes nothing for an FP8 checkpoint, nor its KV fingerprint
    assert _engine(fp8, quantization="fp8").fingerprint == _engine(fp8).fingerprint != _engine(source).fingerprint


def test_quantization_fp8_quantises_every_linear_but_lm_head_one_scale_a_row(tiny_llama, held, tmp_path):
    quantized, _ = load_model(tiny_llama, torch.float32, torch.device("cpu"), quantization="fp8")
    linears = {name: type(m) for name, m in quantized.named_modules() if isinstance(m, (nn.Linear, Fp8Linear))}
    assert linears.pop("lm_head") is nn.Linear and set(linears.values()) == {Fp8Linear if held else nn.Linear}
    if held:
        assert quantized.model.layers[1].self_attn.o_proj.weight_scale.shape == (64, 1)

    # What it should compute: each row scaled to FP8's largest value 448, rounded to FP8, scaled back.
    state = _checkpoint(tiny_llama)
    for key in filter(_is_linear, state):
        scale = state[key].abs().amax(dim=1, keepdim=True) / 448.0
        state[key] = (state[key] / scale).to(FP8).float() * scale
    expected = _derived(Path(tiny_llama), tmp_path / "rounded", state, None)
    logits = _prompt_logits(tiny_llama, quantization="fp8")
    assert torch.equal(logits, _prompt_logits(expected))
    assert _rel(_prompt_logits(tiny_llama), logits) < WEIGHT_TOLERANCE
    quantized = _engine(tiny_llama, quantization="fp8", dtype="bfloat16")
    assert len(quantized.generate([PROMPT], GREEDY)[0]) == 8
    assert quantized.fingerprint != _engine(tiny_llama, dtype="bfloat16").fingerprint  # its KV is not bf16's


def test_dummy_weights_quantise_as_a_checkpoint_does(tiny_llama, monkeypatch):
    """--load-format dummy --quantization fp8 (the GPU benches' FP8 shapes): the random weights go FP8 row by row."""
    monkeypatch.setattr(fp8_checkpoint, "holds_fp8", lambda device: True)
    model, _ = load_model(tiny_llama, torch.bfloat16, torch.device("cpu"), load_format="dummy", quantization="fp8")
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, Fp8Linear) and down.weight.dtype == FP8 and down.weight_scale.shape == (64, 1)
    assert isinstance(model.lm_head, nn.Linear)


def test_the_fp8_gemm_is_the_dequantised_product_within_the_activations_rounding():
    """The CUDA path's call (torch._scaled_mm, per-token activation scales), run here by torch's CPU _scaled_mm:
    within 5% relative error of the dequantised weight's product (FP8 e4m3 keeps 3 mantissa bits; measured 2.7%)."""
    torch.manual_seed(0)
    layer = Fp8Linear(128, 64, True, 1, None)
    weight, scale = quantize_rows(torch.randn(64, 128))
    layer.weight, layer.weight_scale = nn.Parameter(weight, False), nn.Parameter(scale, False)
    layer.bias = nn.Parameter(torch.randn(64, dtype=torch.bfloat16), False)  # the model dtype, as the loader casts it
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    want = x.float() @ dequantize(weight, scale, None, torch.float32).t() + layer.bias
    got = layer._fp8_gemm(x)
    assert got.shape == (3, 5, 64) and got.dtype == torch.bfloat16 and _rel(want, got.float()) < 0.05
    assert not layer.fp8_gemm_applies(x)  # a CPU tensor: the dequantising path runs


def test_quantization_fp8_leaves_a_moe_router_and_refuses_fp8_experts_by_name(tiny_model_dirs, held, tmp_path):
    model, _ = load_model(tiny_model_dirs["qwen3-moe"], torch.float32, torch.device("cpu"), quantization="fp8")
    router = model.model.layers[0].mlp.gate
    assert type(router) is nn.Linear  # and its weights as the checkpoint has them, unrounded
    assert torch.equal(router.weight, _checkpoint(tiny_model_dirs["qwen3-moe"])["model.layers.0.mlp.gate.weight"])
    assert isinstance(model.model.layers[0].self_attn.o_proj, Fp8Linear if held else nn.Linear)
    state = {k: v.to(FP8) if ".experts." in k else v for k, v in _checkpoint(tiny_model_dirs["qwen3-moe"]).items()}
    fp8 = _derived(Path(tiny_model_dirs["qwen3-moe"]), tmp_path / "fp8-experts", state, {"quant_method": "fp8"})
    with pytest.raises(InvalidConfig, match="experts.gate_up_proj is FP8 but not a linear layer's weight"):
        load_model(fp8, torch.float32, torch.device("cpu"))


def test_fp8_weights_split_over_tensor_parallel_ranks_hold_the_whole(tiny_llama, monkeypatch):
    monkeypatch.setattr(fp8_checkpoint, "holds_fp8", lambda device: True)  # a GPU's way, to see the shares
    whole, _ = load_model(tiny_llama, torch.float32, torch.device("cpu"), quantization="fp8")
    ranks = [load_model(tiny_llama, torch.float32, torch.device("cpu"), TensorParallel(r, 2), quantization="fp8")[0]
             for r in range(2)]
    o_proj = [m.model.layers[0].self_attn.o_proj for m in ranks]  # columns split, the row scales whole on each rank
    assert torch.equal(torch.cat([p.weight.view(torch.uint8) for p in o_proj], 1),
                       whole.model.layers[0].self_attn.o_proj.weight.view(torch.uint8))
    assert all(torch.equal(p.weight_scale, whole.model.layers[0].self_attn.o_proj.weight_scale) for p in o_proj)
    gate, up = whole.model.layers[0].mlp.gate_up_proj.weight_scale.chunk(2)  # rows split with their scales
    for rank, model in enumerate(ranks):
        share = torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
        assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight_scale, share)


def test_an_fp8_kv_cache_stores_fp8_and_generates_near_the_model_dtype(tiny_llama):
    engine = _engine(tiny_llama, dtype="bfloat16", kv_cache_dtype="fp8")
    plain = _engine(tiny_llama, dtype="bfloat16")
    assert engine.runner.kv_cache.dtype == FP8 and engine.kv_layout.dtype == "float8_e4m3fn"
    assert engine.kv_layout.block_bytes() * 2 == plain.kv_layout.block_bytes()
    assert engine.fingerprint != plain.fingerprint
    assert len(engine.generate([PROMPT, PROMPT[:5]], GREEDY)[0]) == 8
    assert _rel(_prompt_logits(tiny_llama), _prompt_logits(tiny_llama, kv_cache_dtype="fp8")) < KV_TOLERANCE


@pytest.mark.skipif(cpu_attention.kernel() is None, reason="no C compiler for the CPU attention kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_scale", [1.0, 0.5])
def test_the_cpu_decode_kernel_reads_an_fp8_cache_as_the_gathered_path_does(monkeypatch, dtype, kv_scale):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the kernel's case, whatever the test process has
    torch.manual_seed(2)
    hq, hkv, d = 8, 2, 32
    layout = BatchLayout(query_lens=[1, 1], context_lens=[13, 6], block_tables=[[6, 1, 4, 0], [2, 7]])
    q = torch.randn(2, hq, d, dtype=dtype)
    k, v = torch.randn(2, hkv, d, dtype=dtype), torch.randn(2, hkv, d, dtype=dtype)  # written as FP8 by the forward
    cache = (torch.randn(2, 10, 4, hkv, d) * 3).to(FP8)

    def attend() -> torch.Tensor:
        attention = TorchPagedAttention(4, {None}, torch.device("cpu"), KvCacheFormat(FP8, kv_scale))
        return attention.forward(q, k, v, cache.clone(), attention.prepare(layout), scale=d**-0.5, window=None)

    assert cpu_attention.applies(q, cache[0])
    kernel = attend()
    monkeypatch.setattr(cpu_attention, "applies", lambda *args: False)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernel.float(), attend().float(), atol=tolerance, rtol=tolerance)


# The Triton attention kernels on CPU tensors, in Triton's interpreter (set before triton is imported: its own
# process), float32 (the interpreter has no bf16); K and V values FP8 holds exactly, so that its conversion's
# rounding (the interpreter's own, not a GPU's) plays no part.
_TRITON_FP8 = """
import torch
from common.engine.attention import BatchLayout, TorchPagedAttention
from common.engine.attention_triton import TritonPagedAttention
from common.engine.quantization.kv_cache import KvCacheFormat
TritonPagedAttention._upload = lambda self, array: torch.from_numpy(array)  # no pinned memory without a GPU
torch.manual_seed(0)
cpu, fp8 = torch.device("cpu"), torch.float8_e4m3fn
for layout in (BatchLayout([1, 1], [13, 6], [[6, 1, 4, 0], [2, 7]]), BatchLayout([5, 1], [3, 6], [[6, 1], [2, 7]])):
    t = sum(layout.query_lens)
    q = torch.randn(t, 8, 32)
    k, v = torch.randn(t, 2, 32).to(fp8).float(), torch.randn(t, 2, 32).to(fp8).float()
    cache = torch.randn(2, 10, 4, 2, 32).to(fp8)
    torch_path = TorchPagedAttention(4, {None}, cpu, KvCacheFormat(fp8))
    want = torch_path.forward(q, k, v, cache.clone(), torch_path.prepare(layout), scale=0.2, window=None)
    triton_path = TritonPagedAttention(4, {None}, cpu)
    stored = cache.clone()
    got = triton_path.forward(q, k, v, stored, triton_path.prepare(layout), scale=0.2, window=None)
    torch_path.forward(q, k, v, cache, torch_path.prepare(layout), scale=0.2, window=None)
    print((got - want).abs().max().item(), torch.equal(stored.view(torch.uint8), cache.view(torch.uint8)))
"""


@pytest.fixture(scope="module")
def triton_interpreted() -> dict[str, subprocess.CompletedProcess]:
    """Both Triton-interpreter scripts of this module, run at once (each is seconds of one core)."""
    scripts = {"attention": _TRITON_FP8, "linear": _TRITON_FP8_LINEAR}

    def run(script: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "1"},
                              cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(len(scripts)) as pool:
        return dict(zip(scripts, pool.map(run, scripts.values())))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_triton_kernels_store_and_read_an_fp8_cache_as_the_torch_path_does(triton_interpreted):
    """Decode and prefill (chunked, over cached context): the same K / V bytes stored, the same attention."""
    result = triton_interpreted["attention"]
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split() for line in result.stdout.splitlines()]
    assert len(lines) == 2 and all(float(error) < 1e-5 and same == "True" for error, same in lines), result.stdout


# The batch-1 GEMV on FP8 rows with their scales, and the fused per-token quantisation before an FP8 GEMM, in Triton's
# interpreter (float32 activations: it has no bf16). The activations are values FP8 holds exactly once scaled (a
# power-of-two scale, each row's largest value 448): the interpreter's own float8 rounding (it rounds 31.2 to 16,
# where a GPU gives 32) plays no part; tests/gpu/test_gemv.py checks the rounding against torch on a GPU.
_TRITON_FP8_LINEAR = """
import torch
from common.engine.kernels.gemv import GemvConfig, gemv
from common.engine.quantization.fp8_linear import FP8, FP8_MAX, _MIN_SCALE, dequantize, quantize_rows
from common.engine.quantization.fp8_triton import quantize_tokens
torch.manual_seed(0)
n, k = 48, 256
w, scale = quantize_rows(torch.randn(n, k) * 0.05)
wd, bias, cfg = dequantize(w, scale, None, torch.float32), torch.randn(n), GemvConfig(4, 64, 4, 1)
x, res, nw, gu = torch.randn(1, k), torch.randn(1, k), torch.rand(k) + 0.5, torch.randn(1, 2 * k)
h = x + res
errors = [(gemv(x, w, bias, None, config=cfg, scale=scale) - (x @ wd.T + bias)).abs().max().item()]
y, total = gemv(x, w, None, "add_norm", res, (nw, 1e-5), cfg, scale)
errors += [(y - (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * nw) @ wd.T).abs().max().item(),
           (total - h).abs().max().item()]
y = gemv(gu, w, None, "silu_mul", config=cfg, scale=scale)
errors.append((y - (torch.nn.functional.silu(gu[:, :k]) * gu[:, k:]) @ wd.T).abs().max().item())
exact = torch.randn(4, 1500).clamp(-440, 440).to(FP8).float()
exact[:, 7] = 448.0
exact[3] = 0.0  # an all-zero token
rows = exact * torch.tensor([2.0 ** -6, 1.0, 2.0 ** 3, 1.0])[:, None]
q, s = quantize_tokens(rows, FP8, FP8_MAX, _MIN_SCALE)
want_s = (rows.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
print(max(errors), torch.equal(s, want_s), torch.equal(q.float(), (rows / want_s).to(FP8).float()))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_batch1_gemv_runs_fp8_rows_with_their_scales_and_tokens_quantise_in_one_kernel(triton_interpreted):
    """Each GEMV prologue (none, add + RMSNorm, SiLU·up) over FP8 rows = the dequantised weight's product; the fused
    quantisation gives torch's scales and FP8 values."""
    result = triton_interpreted["linear"]
    assert result.returncode == 0, result.stderr[-3000:]
    error, same_scales, same_values = result.stdout.split()
    assert float(error) < 1e-5 and same_scales == "True" and same_values == "True", result.stdout


def test_raw_block_copies_take_fp8_caches():
    """cuda_ipc's reference copy, and a tensor-parallel GPU cache's scatter into its shards (CPU tensors stand in)."""
    src = torch.randn(2, 2, 5, 4, 2, 8).to(FP8)
    dst = torch.zeros_like(src)
    copy_blocks_reference(src, [3, 1], dst, [0, 2])
    assert torch.equal(dst[:, :, [0, 2]].view(torch.uint8), src[:, :, [3, 1]].view(torch.uint8))
    shards = KvShards([torch.zeros(2, 2, 5, 4, 1, 8, dtype=FP8) for _ in range(2)])
    shards.scatter([4, 0], src[:, :, [3, 1]])
    want = torch.zeros_like(src.view(torch.uint8))  # those two blocks, and the others left as they were
    want[:, :, [4, 0]] = src[:, :, [3, 1]].view(torch.uint8)
    assert torch.equal(torch.cat(shards.shards, dim=4).view(torch.uint8), want)


def _prefill(engine: LLMEngine, prompt):
    engine.add_request("p", prompt, GREEDY, RequestType.CONTEXT_ONLY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    (out,) = outputs
    return out


def _decode(engine: LLMEngine, prompt, first_token: int, kv: KvExport) -> list[int]:
    engine.add_request("d", prompt, GREEDY, RequestType.GENERATION_ONLY, kv_import=kv, first_token=first_token)
    tokens = [first_token]
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


def test_an_fp8_session_moves_prefill_to_decode_as_fp8_and_decodes_as_aggregated(tiny_llama):
    fp8 = {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}
    aggregated = _engine(tiny_llama, **fp8).generate([PROMPT], GREEDY)[0]
    prefill, decode = _engine(tiny_llama, **fp8), _engine(tiny_llama, **fp8)
    out = _prefill(prefill, PROMPT)
    kv = prefill.export_session(out.session_id)
    bf16 = _engine(tiny_llama, dtype="bfloat16")
    bf16_kv = bf16.export_session(_prefill(bf16, PROMPT).session_id)
    assert kv.blocks.dtype == FP8 and kv.blocks.nbytes * 2 == bf16_kv.blocks.nbytes  # half the bytes
    wire = tensor_from_bytes(bytearray(tensor_to_bytes(kv.blocks)), list(kv.blocks.shape), kv.layout.dtype)
    moved = KvExport(kv.layout, kv.num_tokens, wire)  # the raw blocks, as the transports copy them
    assert _decode(decode, PROMPT, out.new_token_ids[0], moved) == aggregated


def test_an_fp8_session_of_two_tensor_parallel_ranks_decodes_on_one_as_aggregated(tiny_llama):
    """FP8 weights and cache on a TP=2 prefill (its ranks share one FP8 cache, each writing its heads), decoded by a
    TP=1 worker: the tokens of either aggregated."""
    fp8 = {"kv_cache_dtype": "fp8", "quantization": "fp8"}
    one = _engine(tiny_llama, **fp8)
    two = _engine(tiny_llama, tensor_parallel_size=2, **fp8)
    try:
        aggregated = two.generate([PROMPT], GREEDY)[0]
        assert aggregated == one.generate([PROMPT], GREEDY)[0]
        out = _prefill(two, PROMPT)
        assert _decode(one, PROMPT, out.new_token_ids[0], two.export_session(out.session_id)) == aggregated
    finally:
        two.close()


def test_a_bf16_decode_worker_refuses_an_fp8_session_naming_both_dtypes(tiny_llama):
    prefill = _engine(tiny_llama, dtype="bfloat16", kv_cache_dtype="fp8")
    session_id = _prefill(prefill, PROMPT).session_id
    kv = prefill.export_session(session_id)
    decode = _engine(tiny_llama, dtype="bfloat16")
    refusal = "dtype: exporter='float8_e4m3fn' importer='bfloat16'; fingerprint: exporter="
    with pytest.raises(LayoutMismatch, match=refusal):
        decode.add_request("d", PROMPT, GREEDY, RequestType.GENERATION_ONLY, kv_import=kv, first_token=5)
    assert not decode.has_unfinished_requests()
    # The decode service's check, before any byte moves: the layout the exporter's ref carries on the wire.
    ref = common_pb2.KvSessionRef.FromString(
        session_ref(prefill.kv_layout, prefill.sessions.get(session_id), "127.0.0.1:1").SerializeToString())
    with pytest.raises(LayoutMismatch, match=refusal):
        decode.kv_layout.check_compatible(layout_of(ref))


def test_fp8_flags_reach_the_engine_config_and_bad_values_are_named(tiny_llama):
    from services.worker.engine_flags import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--model", tiny_llama, "--quantization", "fp8",
                                                        "--kv-cache-dtype", "fp8"]))
    assert (config.quantization, config.kv_cache_dtype) == ("fp8", "fp8")
    with pytest.raises(InvalidConfig, match="--kv-cache-dtype must be one of"):
        EngineConfig(model=tiny_llama, kv_cache_dtype="int8")
    with pytest.raises(InvalidConfig, match="checkpoint quantization 'gptq' is not supported"):
        Fp8Weights.of(SimpleNamespace(quantization_config={"quant_method": "gptq"}), None)

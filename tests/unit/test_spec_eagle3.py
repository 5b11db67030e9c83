"""EAGLE-3 speculative decoding (common/engine/spec/eagle3.py) on the CPU with tiny random targets and random heads
saved in the Hugging Face layout (safetensors): greedy tokens the same as without speculation and as Hugging Face's,
for Llama, Qwen2 and Qwen3 targets; every draft the one an independent EAGLE-3 computation over Hugging Face's hidden
states gives; seeded sampling reproducible; an abort or the end of every request leaving no head block or hidden
state held; the step's rows drafted in one batched call; malformed heads refused at start naming the directory."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from common.engine.spec.acceptance import AcceptancePolicy
from common.engine.spec.config import parse_speculative_config
from common.errors import InvalidConfig
from tests.hf_reference import hf_greedy, hf_model
from tests.tiny_models import _COMMON

PROMPTS = [[5, 6, 7, 8, 9] * 4, [40, 41, 42, 43, 44, 45, 46], list(range(100, 131))]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]
LAYERS = 8  # the default aux layers: the inputs of layers 2, 4 and 5
REPEATS = [300, 301] * 6  # the tiny target answers it with a run of one token (87)
SHAPE = dict(num_key_value_heads=2, num_attention_heads=4, hidden_size=64, intermediate_size=96)


def _target(root, family: str = "llama") -> str:
    config_cls, model_cls, extra = {"llama": (LlamaConfig, LlamaForCausalLM, {}),
                                    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
                                    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32})}[family]
    torch.manual_seed(0)
    config = config_cls(**{**_COMMON, "num_hidden_layers": LAYERS, "num_key_value_heads": 2,
                           "tie_word_embeddings": False, **extra})
    model = model_cls(config).eval()
    if family == "qwen2":  # random init zeroes biases; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(root, safe_serialization=True)
    return str(root)


def head_tensors(draft_vocab: int = 512, own_embeddings: bool = False, seed: int = 3,
                 fc_in: int = 3 * 64) -> dict[str, torch.Tensor]:
    """A random EAGLE-3 head's checkpoint tensors, named as the public checkpoints name them."""
    g = torch.Generator().manual_seed(seed)
    h, kv, inter = 64, 2 * 16, SHAPE["intermediate_size"]

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    tensors = {
        "fc.weight": rand(h, fc_in), "norm.weight": 1 + rand(h), "lm_head.weight": rand(draft_vocab, h),
        "midlayer.input_layernorm.weight": 1 + rand(h), "midlayer.hidden_norm.weight": 1 + rand(h),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h),
        "midlayer.self_attn.q_proj.weight": rand(h, 2 * h), "midlayer.self_attn.k_proj.weight": rand(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * h), "midlayer.self_attn.o_proj.weight": rand(h, h),
        "midlayer.mlp.gate_proj.weight": rand(inter, h), "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
    }
    targets = torch.randperm(512, generator=g)[:draft_vocab].sort().values
    tensors["d2t"] = targets - torch.arange(draft_vocab)
    tensors["t2d"] = torch.zeros(512, dtype=torch.bool).index_fill_(0, targets, True)
    if own_embeddings:
        tensors["embed_tokens.weight"] = rand(512, h)
    return tensors


def save_head(root, tensors: dict[str, torch.Tensor], **config) -> str:
    """The head's config.json (a one-layer LlamaConfig and the EAGLE-3 keys) and model.safetensors in `root`."""
    root.mkdir(parents=True, exist_ok=True)
    draft_vocab = tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors else 512
    llama = LlamaConfig(**{**_COMMON, **SHAPE, "num_hidden_layers": 1, "tie_word_embeddings": False})
    llama.architectures = ["LlamaForCausalLMEagle3"]
    llama.draft_vocab_size = draft_vocab
    for key, value in config.items():
        setattr(llama, key, value)
    llama.save_pretrained(root)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    return str(root)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return _target(tmp_path_factory.mktemp("eagle3-target"))


@pytest.fixture(scope="module")
def head(tmp_path_factory) -> str:
    return save_head(tmp_path_factory.mktemp("eagle3-head"), head_tensors())


def _spec(model: str, k: int = 3) -> str:
    return json.dumps({"method": "eagle3", "model": model, "num_speculative_tokens": k})


def _engine(model: str, spec: str | None, **overrides) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=model, speculative_config=parse_speculative_config(spec),
                                    **{"block_size": 4, "num_kv_blocks": 128, **overrides}))
    if spec is not None:  # every row drafts K whatever its acceptance (the default policy stops failing drafts)
        engine.speculator.set_policies({1: AcceptancePolicy.linear(3, 0.0)})
    return engine


def _count(engine: LLMEngine, name: str) -> float:
    return engine.speculator.metrics.total(f"disagg_spec_decode_{name}_total", method="eagle3")


def _holds_nothing(engine: LLMEngine) -> bool:
    proposer = engine.speculator.proposer
    return (not proposer._rows and not proposer._hidden and engine.block_manager.num_free_blocks
            == engine.block_manager.num_blocks and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_with_an_eagle3_head_are_those_without_it_and_hfs(target, head, device):
    engine = _engine(target, _spec(head), device=device)
    got = engine.generate(PROMPTS, GREEDY)
    assert got == _engine(target, None, device=device).generate(PROMPTS, GREEDY)
    assert got == [hf_greedy(target, p, GREEDY.max_tokens)[0] for p in PROMPTS]
    assert _count(engine, "draft_tokens") > 0 and _count(engine, "drafts") > 0
    assert engine.runner.model.aux_layers == (2, 4, 5)
    assert (engine.runner.graphs is not None) == (device == "cuda")  # a GPU target replays its graphs beside a head
    assert _holds_nothing(engine)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_qwen_target_with_an_eagle3_head_keeps_its_greedy_tokens(tmp_path, head, family):
    qwen = _target(tmp_path / family, family)
    engine = _engine(qwen, _spec(head))
    got = engine.generate(PROMPTS, GREEDY)
    assert got == _engine(qwen, None).generate(PROMPTS, GREEDY)
    assert got == [hf_greedy(qwen, p, GREEDY.max_tokens)[0] for p in PROMPTS]
    assert _count(engine, "draft_tokens") > 0


# --- the drafts themselves, against EAGLE-3 computed from scratch over Hugging Face's hidden states ---

def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _head_layer(w: dict, config: LlamaConfig, embeds: torch.Tensor, hidden: torch.Tensor):
    """The head over a whole sequence of (embedding, hidden state) inputs at positions 0..n-1, causal, no cache:
    (normed output, pre-norm output) [n, hidden]."""
    n, heads, kv_heads, dim = len(embeds), 4, 2, 16
    m = "midlayer."
    x = torch.cat([_rms(embeds, w[m + "input_layernorm.weight"]), _rms(hidden, w[m + "hidden_norm.weight"])], -1)
    q = (x @ w[m + "self_attn.q_proj.weight"].T).view(n, heads, dim).transpose(0, 1)[None]
    k = (x @ w[m + "self_attn.k_proj.weight"].T).view(n, kv_heads, dim).transpose(0, 1)[None]
    v = (x @ w[m + "self_attn.v_proj.weight"].T).view(n, kv_heads, dim).transpose(0, 1)[None]
    cos, sin = LlamaRotaryEmbedding(config)(v, torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1).reshape(n, -1)
    residual = hidden + attn @ w[m + "self_attn.o_proj.weight"].T
    y = _rms(residual, w[m + "post_attention_layernorm.weight"])
    gate, up = y @ w[m + "mlp.gate_proj.weight"].T, y @ w[m + "mlp.up_proj.weight"].T
    prenorm = residual + (F.silu(gate) * up) @ w[m + "mlp.down_proj.weight"].T
    return _rms(prenorm, w["norm.weight"]), prenorm


@torch.inference_mode()
def reference_drafts(target_dir: str, head_dir: str, history: list[int], k: int, layers: tuple[int, ...]):
    """EAGLE-3's k greedy drafts after `history`: the target's residual stream entering `layers` at each position
    but the last, beside the token after it; then each draft beside the head's own pre-norm output before it."""
    hf = hf_model(target_dir)
    states = hf(torch.tensor([history[:-1]]), output_hidden_states=True).hidden_states  # [i]: layer i's input
    w = load_file(f"{head_dir}/model.safetensors")
    config = LlamaConfig.from_pretrained(head_dir)
    embedding = w.get("embed_tokens.weight", hf.model.embed_tokens.weight)
    embeds = embedding[torch.tensor(history[1:])]
    hidden = torch.cat([states[i][0] for i in layers], -1) @ w["fc.weight"].T
    drafts = []
    for _ in range(k):
        normed, prenorm = _head_layer(w, config, embeds, hidden)
        draft = int((normed[-1] @ w["lm_head.weight"].T).argmax())
        drafts.append(draft + int(w["d2t"][draft]))
        embeds, hidden = torch.cat([embeds, embedding[drafts[-1]][None]]), torch.cat([hidden, prenorm[-1:]])
    return drafts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["default", "own-embeddings-small-vocab-sglang-ids", "two-tokens-accepted"])
def test_every_draft_is_the_one_eagle3_computed_from_scratch_gives(target, tmp_path, variant, device):
    if variant == "default":
        head_dir, layers = save_head(tmp_path / "head", head_tensors()), (2, 4, 5)
    elif variant == "two-tokens-accepted":  # 87, the token the target repeats after REPEATS, and another: drafts
        tensors = head_tensors(draft_vocab=2)  # are accepted, so a proposal runs several positions it had not
        tensors["d2t"] = torch.tensor([87, 300]) - torch.arange(2)
        head_dir, layers = save_head(tmp_path / "head", tensors), (2, 4, 5)
    else:  # SGLang's eagle_config names layer outputs: 0, 3 and 6 are the inputs of 1, 4 and 7
        head_dir = save_head(tmp_path / "head", head_tensors(draft_vocab=64, own_embeddings=True, seed=5),
                             eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 6]})
        layers = (1, 4, 7)
    engine = _engine(target, _spec(head_dir), device=device)
    proposer = engine.speculator.proposer
    assert engine.runner.model.aux_layers == layers
    calls, batched = [], proposer.propose_many

    def recorded(histories, ks, ids):
        drafts = batched(histories, ks, ids)
        calls.extend(zip([list(map(int, h)) for h in histories], ks, drafts))
        return drafts

    proposer.propose_many = recorded
    engine.generate(PROMPTS + [REPEATS], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert len(calls) >= 4 * 4
    for history, k, drafts in calls:
        assert drafts == reference_drafts(target, head_dir, history, k, layers), (len(history), k)
    assert variant != "two-tokens-accepted" or _count(engine, "accepted_tokens") >= 1


def test_a_head_whose_drafts_the_target_accepts_emits_them_and_keeps_its_tokens(target, tmp_path):
    """A head with a one-token vocabulary, the token the target repeats greedily: drafts are accepted, so a verify
    emits several tokens and the head runs the accepted positions at its next proposal."""
    prompt = REPEATS
    plain = _engine(target, None).generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    token = max(set(plain[0]), key=plain[0].count)
    tensors = head_tensors(draft_vocab=1)
    tensors["d2t"] = torch.tensor([token])
    engine = _engine(target, _spec(save_head(tmp_path / "head", tensors)))
    assert engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) == plain
    assert _count(engine, "accepted_tokens") >= 3
    assert _holds_nothing(engine)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_draws_the_same_tokens_with_an_eagle3_head(target, head, device):
    sampling = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)
    expected = _engine(target, None, device=device).generate(PROMPTS, sampling)
    assert _engine(target, _spec(head), device=device).generate(PROMPTS, sampling) == expected
    assert _engine(target, _spec(head), device=device).generate(PROMPTS, sampling) == expected


def test_the_step_drafts_every_row_in_one_batched_call(target, head):
    engine = _engine(target, _spec(head))
    proposer = engine.speculator.proposer
    calls, batched = [], proposer.propose_many
    proposer.propose_many = lambda histories, ks, ids: calls.append(len(histories)) or batched(histories, ks, ids)
    assert engine.generate(PROMPTS, GREEDY) == _engine(target, None).generate(PROMPTS, GREEDY)
    assert calls and max(calls) == len(PROMPTS)


@pytest.mark.parametrize("device", DEVICES)
def test_an_abort_mid_speculation_leaves_no_head_block_or_hidden_state(target, head, device):
    engine = _engine(target, _spec(head), device=device)
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(4):
        engine.step()
    proposer = engine.speculator.proposer
    assert _count(engine, "drafts") > 0 and proposer.blocks.num_free_blocks < proposer.blocks.num_blocks
    engine.abort_request("a")
    engine.abort_request("b")
    assert _holds_nothing(engine) and not engine.speculator._rows


def test_a_prompt_from_the_prefix_cache_drafts_from_the_positions_computed_and_keeps_its_tokens(target, head):
    engine = _engine(target, _spec(head))
    first = engine.generate([PROMPTS[2]], GREEDY)
    drafts = _count(engine, "drafts")
    assert engine.generate([PROMPTS[2]], GREEDY) == first  # its full blocks come from the prefix cache
    assert engine.block_manager.prefix_hit_tokens > 0 and _count(engine, "drafts") > drafts
    assert _holds_nothing(engine)


@pytest.mark.parametrize("broken, words", [
    ("no-fc", r"lacks \['fc.weight'\]"),
    ("other-target", "reads 96 target features"),
    ("not-eagle", "is not an EAGLE-3 head"),
    ("other-vocab", "vocabulary of 256 tokens"),
    ("wrong-shape", "does not match its config.json"),
    ("no-config", "no EAGLE-3 head config"),
])
def test_a_malformed_head_is_refused_at_start_naming_its_directory(target, tmp_path, broken, words):
    tensors = head_tensors(fc_in=96 if broken == "other-target" else 3 * 64)
    config = {}
    if broken == "no-fc":
        del tensors["fc.weight"]
    elif broken == "wrong-shape":
        tensors["midlayer.self_attn.q_proj.weight"] = tensors["midlayer.self_attn.q_proj.weight"][:, :64]
    elif broken == "not-eagle":
        config["architectures"] = ["LlamaForCausalLM"]
    elif broken == "other-vocab":
        config["vocab_size"] = 256
    root = tmp_path / "head"
    if broken == "no-config":
        root.mkdir()
    else:
        save_head(root, tensors, **config)
    with pytest.raises(InvalidConfig, match=words) as raised:
        _engine(target, _spec(str(root)))
    assert str(root) in str(raised.value) and "--speculative-config" in str(raised.value)


@pytest.mark.parametrize("family", ["phi3", "mixtral"])
def test_a_target_family_other_than_llama_and_qwen_is_refused_naming_it(tiny_model_dirs, head, family):
    with pytest.raises(InvalidConfig, match="eagle3 heads run on Llama, Mistral and Qwen2/Qwen3 targets") as raised:
        _engine(tiny_model_dirs[family], _spec(head))
    assert tiny_model_dirs[family] in str(raised.value)


def test_hidden_states_of_requests_that_never_draft_are_not_kept(target, head):
    engine = _engine(target, _spec(head))
    proposer = engine.speculator.proposer
    engine.add_request("penalised", PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, presence_penalty=0.5))
    engine.step()
    assert "penalised" not in proposer._hidden
    while engine.has_unfinished_requests():
        engine.step()
    assert _holds_nothing(engine)


def _configured(spec, target: str, head_dir: str):
    parser = argparse.ArgumentParser()
    spec.add_args(parser)
    args = parser.parse_args(["--model", target, "--device", "cpu", "--num-kv-blocks", "64",
                              "--speculative-config", _spec(head_dir)])
    return args, spec.configure(args)


def test_a_prefill_worker_given_a_speculative_config_loads_no_head_and_a_decode_worker_keeps_it(target, tmp_path):
    from services.decode.__main__ import SPEC as DECODE
    from services.prefill.__main__ import SPEC as PREFILL
    from services.worker.engine_flags import effective_engine_json

    missing = str(tmp_path / "no-head-here")  # loading it would fail: the prefill worker must not try
    args, config = _configured(PREFILL, target, missing)
    assert config.speculative_config is None
    assert json.loads(effective_engine_json(args, config))["speculative-config"] is None
    assert LLMEngine(config).speculator is None
    _, config = _configured(DECODE, target, missing)
    assert config.speculative_config is not None and config.speculative_config.model == missing


def test_the_draft_costs_bench_times_an_eagle3_head_with_random_weights(target, tmp_path):
    from benchmarks.spec_decode import draft_costs

    head_dir = tmp_path / "config-only-head"
    save_head(head_dir, head_tensors())
    (head_dir / "model.safetensors").unlink()  # --dummy: config.json alone
    rows = draft_costs(target, str(head_dir), 2, "cpu", dummy=True)
    assert [r["batch"] for r in rows] == [1, 8, 32]
    assert all(r["propose_ms"] > 0 and r["verify_ms"] > 0 and r["step_cost"] >= 1.0 for r in rows)

"""Tensor parallelism on the CPU (gloo, one process per rank): greedy output at TP=2 and TP=4 equals TP=1 and
Hugging Face for every family whose heads divide, in aggregated and prefill→decode modes; a session exported
at one TP size is imported at another; cancels free every block; sizes that do not divide are refused by name.
The tests that start ranks are slow: a follower rank is a process."""
from __future__ import annotations

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.models.sharding import Colwise, Rowwise, VocabRows, shard_state
from common.engine.parallel import TensorParallel
from common.engine.request import SamplingParams
from common.engine.start import check_startable
from common.errors import InvalidConfig
from tests.hf_reference import hf_greedy
from tests.tiny_models import make_tiny_model
from tests.unit.test_kv_handoff import _decode, _prefill

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# Every family whose 4 attention heads and KV heads divide by 2 (llama-tied-rope-scaled has one KV head).
TP2_FAMILIES = ["llama-gqa", "qwen2-bias", "qwen3-qknorm", "mistral", "phi3"]


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _engine(path: str, tp: int, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, tensor_parallel_size=tp,
                                  **{"block_size": 4, "num_kv_blocks": 64, **overrides}))


@pytest.fixture(scope="module")
def mha_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tp") / "llama-mha-bias", "llama-mha-bias"))


@pytest.fixture(scope="module")
def mha_engines(mha_model):
    """The 4-KV-head model at TP 1, 2 and 4, shared by the module's tests (each follower rank is a process)."""
    engines = {tp: _engine(mha_model, tp) for tp in (1, 2, 4)}
    yield engines
    for engine in engines.values():
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", TP2_FAMILIES)
def test_tp2_greedy_equals_tp1_and_hf(tiny_model_dirs, family):
    path = tiny_model_dirs[family]
    prompts = _prompts([5, 11, 23])  # 23 tokens: chunked prefill (several steps) on the way
    engine = _engine(path, 2, long_prefill_token_threshold=8)
    try:
        got = engine.generate(prompts, GREEDY)
        assert engine.block_manager.num_free_blocks == 64
    finally:
        engine.close()
    assert got == _engine(path, 1).generate(prompts, GREEDY)
    assert got == [hf_greedy(path, p, 10)[0] for p in prompts]


@pytest.mark.slow
def test_tp4_with_biases_greedy_equals_tp1_and_hf(mha_model, mha_engines):
    prompts = _prompts([7, 19], seed=3)
    got = mha_engines[4].generate(prompts, GREEDY)
    assert got == mha_engines[1].generate(prompts, GREEDY)
    assert got == [hf_greedy(mha_model, p, 10)[0] for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_a_session_exported_at_one_tp_size_decodes_at_another(mha_engines, prefill_tp, decode_tp):
    prompt = _prompts([19], seed=5)[0]
    want = mha_engines[1].generate([prompt], GREEDY)[0]
    prefill, decode = mha_engines[prefill_tp], mha_engines[decode_tp]
    out = _prefill(prefill, prompt)
    kv = prefill.export_session(out.session_id)
    prefill.release_session(out.session_id)
    assert _decode(decode, prompt, out.new_token_ids[0], kv) == want
    assert prefill.block_manager.num_free_blocks == decode.block_manager.num_free_blocks == 64


@pytest.mark.slow
def test_an_abort_mid_generation_frees_every_block_and_the_ranks_keep_serving(mha_model, mha_engines):
    """On the module's shared TP=2 engine (starting one costs a follower process): the tests after it use it too."""
    engine = mha_engines[2]
    prompts = _prompts([9, 14], seed=7)
    engine.add_request("a", prompts[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.add_request("b", prompts[1], SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.abort_request("a") and engine.abort_request("b")
    assert engine.block_manager.num_free_blocks == 64
    assert engine.generate(prompts[:1], GREEDY) == [hf_greedy(mha_model, prompts[0], 10)[0]]


@pytest.mark.slow
def test_seeded_sampling_is_the_same_at_tp1_and_tp2(mha_engines):
    sampling = SamplingParams(temperature=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    got = mha_engines[2].generate(_prompts([12]), sampling)
    assert got == mha_engines[1].generate(_prompts([12]), sampling)


def test_a_size_that_does_not_divide_the_kv_heads_is_refused_before_any_rank_starts(tiny_model_dirs):
    with pytest.raises(InvalidConfig, match="--tensor-parallel-size 2 does not divide the model's 1 KV heads"):
        _engine(tiny_model_dirs["llama-tied-rope-scaled"], 2)


def test_tensor_parallelism_runs_on_the_cpu_or_on_gpus_and_nowhere_else():
    EngineConfig(model="m", device="cuda:1", tensor_parallel_size=2, async_scheduling=True)
    with pytest.raises(InvalidConfig, match="--tensor-parallel-size 2 runs on --device cpu .gloo. or cuda"):
        EngineConfig(model="m", device="mps", tensor_parallel_size=2)


def test_more_ranks_than_gpus_are_refused_by_name_before_any_rank_starts(tiny_model_dirs):
    have = torch.cuda.device_count()
    config = EngineConfig(model=tiny_model_dirs["llama-gqa"], device=f"cuda:{have}", tensor_parallel_size=2)
    with pytest.raises(InvalidConfig, match=rf"needs GPUs cuda:{have}..cuda:{have + 1}, one a rank; this process "
                                            rf"sees {have}"):
        check_startable(config)


def test_shards_reassemble_into_the_checkpoint():
    q, kv, hidden = 8, 4, 6
    qkv = torch.arange((q + 2 * kv) * hidden, dtype=torch.float).reshape(q + 2 * kv, hidden)
    o_proj, o_bias = torch.randn(hidden, q), torch.randn(hidden)
    embed = torch.randn(11, hidden)  # 11 rows: the last of 2 shares is padded
    state = {"layers.0.self_attn.qkv_proj.weight": qkv, "layers.0.self_attn.o_proj.weight": o_proj,
             "layers.0.self_attn.o_proj.bias": o_bias, "model.embed_tokens.weight": embed}
    plan = {"self_attn.qkv_proj": Colwise((q, kv, kv)), "self_attn.o_proj": Rowwise(),
            "embed_tokens": VocabRows(11)}
    shards = [shard_state(state, plan, TensorParallel(rank, 2)) for rank in range(2)]
    per_rank = [s["layers.0.self_attn.qkv_proj.weight"].split([q // 2, kv // 2, kv // 2]) for s in shards]
    for part in range(3):  # each rank holds its q rows ‖ its k rows ‖ its v rows
        assert torch.equal(torch.cat([r[part] for r in per_rank]), qkv.split([q, kv, kv])[part])
    assert torch.equal(torch.cat([s["layers.0.self_attn.o_proj.weight"] for s in shards], dim=1), o_proj)
    assert torch.equal(shards[0]["layers.0.self_attn.o_proj.bias"], o_bias)
    assert not shards[1]["layers.0.self_attn.o_proj.bias"].any()  # added once, by rank 0
    rows = [s["model.embed_tokens.weight"] for s in shards]
    assert [len(r) for r in rows] == [6, 6] and not rows[1][5].any()
    assert torch.equal(torch.cat(rows)[:11], embed)


@pytest.mark.slow
def test_smollm2_at_tp3_answers_as_at_tp1_and_hf():
    """The real SmolLM2-135M: 9 attention heads and 3 KV heads, so 3 ranks of one KV head each (2 does not divide)."""
    from common.engine.default_model import default_model_dir
    from common.tokenizer import Tokenizer

    model = str(default_model_dir())
    prompt = Tokenizer.from_model_dir(model).apply_chat_template([{"role": "user", "content": "Name a sea."}])
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=64, tensor_parallel_size=3))
    try:
        got = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    finally:
        engine.close()
    assert got == hf_greedy(model, prompt, 12)[0]
    with pytest.raises(InvalidConfig, match="--tensor-parallel-size 2 does not divide the model's 9 attention heads"):
        LLMEngine(EngineConfig(model=model, tensor_parallel_size=2))


@pytest.fixture(scope="module")
def async_tp2(tiny_model_dirs) -> LLMEngine:
    """A TP=2 llama-gqa engine with async scheduling, shared by the tests of steps launched ahead (each leaves it
    idle, every block free)."""
    engine = _engine(tiny_model_dirs["llama-gqa"], 2, async_scheduling=True)
    yield engine
    engine.close()


@pytest.mark.slow
def test_steps_launched_ahead_feed_each_ranks_own_greedy_tokens(async_tp2, tiny_model_dirs):
    """Async scheduling at TP=2: a step launched ahead names only the rows (its tokens are still on rank 0's
    device); each follower feeds the greedy tokens of its own copy of the logits, so the output stays exact."""
    path, engine = tiny_model_dirs["llama-gqa"], async_tp2
    prompts = _prompts([6, 13, 21], seed=11)
    ahead, launch_ahead = [], engine.runner.launch_ahead
    engine.runner.launch_ahead = lambda prev, rows, joined=(): ahead.append(rows) or launch_ahead(prev, rows, joined)
    try:
        got = engine.generate(prompts, GREEDY)
    finally:
        engine.runner.launch_ahead = launch_ahead
    assert ahead and engine.block_manager.num_free_blocks == 64
    assert got == [hf_greedy(path, p, 10)[0] for p in prompts]


@pytest.mark.slow
def test_a_handed_off_request_joins_a_step_launched_ahead_on_every_rank(async_tp2, tiny_model_dirs):
    """At TP=2 a request that joins a step launched ahead (its KV placed in our blocks, its first token known on the
    host) reaches the followers as that step's input_ids, after their own greedy tokens: the output stays exact."""
    from tests.unit.test_async_scheduling import _step, handed_off_mid_pipeline

    path = tiny_model_dirs["llama-gqa"]
    running, handed_off = _prompts([7, 15], seed=12)
    exporter, engine = _engine(path, 1), async_tp2
    try:
        tokens, first = handed_off_mid_pipeline(exporter, engine, running, handed_off, GREEDY, 3)
        while engine.has_unfinished_requests():
            _step(engine, tokens)
            assert not engine.scheduler.waiting  # it joined at once: no step went without it
        assert engine.block_manager.num_free_blocks == 64
    finally:
        exporter.close()
    assert tokens["running"] == hf_greedy(path, running, 10)[0]
    assert [first] + tokens["joined"] == hf_greedy(path, handed_off, 10)[0]

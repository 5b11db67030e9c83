"""context_only (prefill) → export → import → generation_only (decode) gives the aggregated tokens."""
import time

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import FinishReason, RequestType, SamplingParams
from common.errors import InvalidRequest, LayoutMismatch, NotFound, SessionExpired
from common.kv.layout import KvExport

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _engine(path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, **{"block_size": 4, "num_kv_blocks": 64, **overrides}))


def _prefill(engine: LLMEngine, prompt, sampling=GREEDY):
    engine.add_request("p", prompt, sampling, RequestType.CONTEXT_ONLY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    (out,) = outputs
    return out


def _decode(engine: LLMEngine, prompt, first_token, kv, sampling=GREEDY) -> list[int]:
    engine.add_request("d", prompt, sampling, RequestType.GENERATION_ONLY, kv_import=kv, first_token=first_token)
    tokens = [first_token]
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


def test_prefill_export_then_decode_import_matches_aggregated(tiny_llama):
    prompt = torch.randint(3, 512, (19,), generator=torch.Generator().manual_seed(0)).tolist()
    aggregated = _engine(tiny_llama).generate([prompt], GREEDY)[0]

    prefill, decode = _engine(tiny_llama), _engine(tiny_llama)
    out = _prefill(prefill, prompt)
    assert out.finish_reason is FinishReason.CONTEXT_DONE and out.session_id
    assert prefill.block_manager.num_free_blocks == 64 - 5  # 19 tokens in 4-token blocks, pinned
    kv = prefill.export_session(out.session_id)
    assert kv.num_tokens == 19 and tuple(kv.blocks.shape) == kv.layout.block_shape(5)
    prefill.release_session(out.session_id)
    assert prefill.block_manager.num_free_blocks == 64

    assert _decode(decode, prompt, out.new_token_ids[0], kv) == aggregated
    assert decode.block_manager.num_free_blocks == 64


def test_seeded_sampling_is_the_same_aggregated_and_disaggregated(tiny_llama):
    prompt = list(range(10, 30))
    sampling = SamplingParams(temperature=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    aggregated = _engine(tiny_llama).generate([prompt], sampling)[0]
    prefill, decode = _engine(tiny_llama), _engine(tiny_llama)
    out = _prefill(prefill, prompt, sampling)
    tokens = _decode(decode, prompt, out.new_token_ids[0], prefill.export_session(out.session_id), sampling)
    assert tokens == aggregated


def test_fingerprint_mismatch_names_both_sides(tiny_model_dirs):
    prompt = list(range(3, 15))
    prefill = _engine(tiny_model_dirs["llama-gqa"])
    kv = prefill.export_session(_prefill(prefill, prompt).session_id)
    other_model = _engine(tiny_model_dirs["qwen2-bias"])
    with pytest.raises(LayoutMismatch, match=r"fingerprint: exporter='[0-9a-f]+' importer='[0-9a-f]+'"):
        other_model.add_request("d", prompt, GREEDY, RequestType.GENERATION_ONLY, kv_import=kv, first_token=5)
    other_dtype = _engine(tiny_model_dirs["llama-gqa"], dtype="bfloat16")
    with pytest.raises(LayoutMismatch, match="dtype: exporter='float32' importer='bfloat16'"):
        other_dtype.add_request("d", prompt, GREEDY, RequestType.GENERATION_ONLY, kv_import=kv, first_token=5)
    other_blocks = _engine(tiny_model_dirs["llama-gqa"], block_size=8)
    with pytest.raises(LayoutMismatch, match="block_size: exporter=4 importer=8"):
        other_blocks.add_request("d", prompt, GREEDY, RequestType.GENERATION_ONLY, kv_import=kv, first_token=5)
    for engine in (other_model, other_dtype, other_blocks):
        assert not engine.has_unfinished_requests()


def test_tensor_that_lies_about_its_layout_is_rejected(tiny_llama):
    prompt = list(range(3, 15))
    prefill = _engine(tiny_llama)
    kv = prefill.export_session(_prefill(prefill, prompt).session_id)
    truncated = KvExport(kv.layout, kv.num_tokens, kv.blocks[:, :, :1])
    with pytest.raises(LayoutMismatch, match="does not match its layout"):
        _engine(tiny_llama).add_request("d", prompt, GREEDY, RequestType.GENERATION_ONLY,
                                        kv_import=truncated, first_token=5)
    with pytest.raises(InvalidRequest, match="covers 12 tokens, the prompt has 11"):
        _engine(tiny_llama).add_request("d", prompt[:-1], GREEDY, RequestType.GENERATION_ONLY,
                                        kv_import=kv, first_token=5)


def test_unpulled_session_expires_and_frees_its_blocks(tiny_llama):
    prefill = _engine(tiny_llama, session_ttl_s=0.05)
    out = _prefill(prefill, list(range(3, 20)))
    assert prefill.block_manager.num_free_blocks < 64
    time.sleep(0.1)
    assert prefill.expire_sessions() == 1
    assert prefill.block_manager.num_free_blocks == 64
    assert prefill.sessions.num_expired == 1
    with pytest.raises(SessionExpired, match="expired after its TTL"):
        prefill.export_session(out.session_id)
    with pytest.raises(NotFound, match="no KV session"):
        prefill.release_session("nope")


def test_context_only_that_hits_eos_returns_no_session(tiny_llama):
    prefill = _engine(tiny_llama)
    out = _prefill(prefill, list(range(3, 20)), SamplingParams(temperature=0, max_tokens=1))
    assert out.finish_reason is FinishReason.LENGTH and out.session_id is None
    assert prefill.block_manager.num_free_blocks == 64


@pytest.mark.parametrize("growth_reserve", [0, 256])
def test_handoffs_into_a_pool_too_small_for_all_match_aggregated(tiny_llama, growth_reserve):
    """Three handoffs whose KV outgrows a 16-block decode pool together. Admitted while blocks last (no growth
    reserve), the newest are preempted and recompute their prompts on the decode engine; with the default reserve
    a handoff waits in the queue (its KV held beside the pool) until the running rows have room to finish, and
    nobody is preempted. Either way the tokens are the aggregated engine's and every block comes back."""
    prompts = [list(range(3 + i, 23 + i)) for i in range(3)]
    sampling = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    aggregated = _engine(tiny_llama).generate(prompts, sampling)
    prefill = _engine(tiny_llama)
    decode = _engine(tiny_llama, num_kv_blocks=16, enable_prefix_caching=False, kv_growth_reserve=growth_reserve)
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"p{i}", prompt, sampling, RequestType.CONTEXT_ONLY)
    firsts = {}
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            firsts[out.request_id] = out
    for i, prompt in enumerate(prompts):
        out = firsts[f"p{i}"]
        decode.add_request(f"d{i}", prompt, sampling, RequestType.GENERATION_ONLY,
                           kv_import=prefill.export_session(out.session_id), first_token=out.new_token_ids[0])
    tokens = {f"d{i}": [firsts[f"p{i}"].new_token_ids[0]] for i in range(3)}
    queued = 0
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens[out.request_id].extend(out.new_token_ids)
        queued += bool(decode.scheduler.waiting)
    if growth_reserve:
        assert decode.num_preemptions == 0 and queued > 0
    else:
        assert decode.num_preemptions > 0
    assert [tokens[f"d{i}"] for i in range(3)] == aggregated
    assert decode.block_manager.num_free_blocks == 16


def test_context_only_prompts_keep_no_growth_reserve(tiny_llama):
    """A prefill worker's prompts never grow past their prompt (the first token's KV is the decode worker's): three
    prompts that fill the pool but for one block all start in the first step, as without a reserve."""
    prefill = _engine(tiny_llama, num_kv_blocks=16, enable_prefix_caching=False)
    for i in range(3):
        prefill.add_request(f"p{i}", list(range(3 + i, 23 + i)), SamplingParams(temperature=0, max_tokens=64),
                            RequestType.CONTEXT_ONLY)
    first_step = prefill.step()
    assert sorted(out.request_id for out in first_step) == ["p0", "p1", "p2"]
    assert all(out.session_id for out in first_step) and prefill.block_manager.num_free_blocks == 1

"""The engine stamps when a request arrived, was first scheduled and had its first token read back: the workers'
parts of the TTFT breakdown (prefill queue, prefill compute, first decode step) are differences of these."""
import time

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import RequestType, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _engine(path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, **{"block_size": 4, "num_kv_blocks": 64, **overrides}))


def _run(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def test_a_chunked_prefill_is_stamped_at_its_first_chunk_and_its_first_token(tiny_llama):
    engine = _engine(tiny_llama, max_num_batched_tokens=8)  # 20 prompt tokens: three steps before the first token
    before = time.monotonic()
    request = engine.add_request("a", list(range(10, 30)), GREEDY)
    assert request.first_scheduled_time is None and request.first_token_time is None
    engine.step()
    scheduled = request.first_scheduled_time
    assert before <= request.arrival_time <= scheduled <= time.monotonic()
    engine.step()
    assert request.first_scheduled_time == scheduled and request.first_token_time is None  # still prefilling
    first, *rest = _run(engine)
    assert first.new_token_ids and first.first_scheduled_time == scheduled
    assert scheduled < first.first_token_time <= time.monotonic()
    assert len(rest) == GREEDY.max_tokens - 1
    assert all(out.first_scheduled_time is None and out.first_token_time is None for out in rest)


def test_a_request_queued_behind_another_is_first_scheduled_after_it_ends(tiny_llama):
    engine = _engine(tiny_llama, max_num_seqs=1)
    engine.add_request("a", list(range(10, 20)), GREEDY)
    second = engine.add_request("b", list(range(40, 50)), GREEDY)
    outputs = {out.request_id: out for out in reversed(_run(engine))}  # each request's first output
    assert outputs["b"].first_scheduled_time == second.first_scheduled_time
    # its queue holds the whole of the first request's prefill
    a, b = outputs["a"], outputs["b"]
    assert second.arrival_time < a.first_token_time < second.first_scheduled_time < b.first_token_time


def test_generation_only_stamps_its_first_generated_token_not_the_imported_one(tiny_llama):
    prompt = list(range(10, 29))
    prefill, decode = _engine(tiny_llama), _engine(tiny_llama)
    prefill.add_request("p", prompt, GREEDY, RequestType.CONTEXT_ONLY)
    (context,) = _run(prefill)
    assert context.first_scheduled_time <= context.first_token_time  # the prefill worker's queue and compute
    kv = prefill.export_session(context.session_id)
    request = decode.add_request("d", prompt, GREEDY, RequestType.GENERATION_ONLY, kv_import=kv,
                                 first_token=context.new_token_ids[0])
    assert request.first_token_time is None  # the imported first token is prefill's, not this engine's
    first, *rest = _run(decode)
    assert request.arrival_time <= first.first_scheduled_time <= first.first_token_time
    assert all(out.first_token_time is None for out in rest)

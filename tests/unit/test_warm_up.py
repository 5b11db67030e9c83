"""The warm-up a GPU engine runs before its worker says SERVING (common/engine/warm_up.py), run here on the CPU: every
kind of request it sends runs to the end, and it leaves the engine as it found it (no request, every block free,
nothing in the prefix cache, no preemption counted); on the CPU by default it runs nothing."""
import shutil

from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from common.engine.warm_up import SAMPLING_WAYS, warm_up


def test_the_warm_up_runs_every_kind_and_leaves_no_trace(tiny_llama, tmp_path):
    model = shutil.copytree(tiny_llama, tmp_path / "with-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, model / name)
    engine = LLMEngine(EngineConfig(model=str(model), block_size=4, num_kv_blocks=256, max_num_batched_tokens=160,
                                    max_num_seqs=8))
    assert warm_up(engine) is None  # the CPU's default: nothing to build
    added = []
    add = engine.add_request
    engine.add_request = lambda request_id, *args, **kwargs: added.append(request_id) or add(request_id, *args,
                                                                                                 **kwargs)
    assert warm_up(engine, full=True) > 0
    assert {"warm-up-grammar", "warm-up-prompt-160", "warm-up-prompt-159"} <= set(added), added
    assert {f"warm-up-{way}" for way in SAMPLING_WAYS} <= set(added), added  # each way of sampling alone
    # prompts of 16, 128 and the budget, each also one token short (an odd size: Triton's other specialisation);
    # each way of sampling alone, then a batch of max_num_seqs of them; one under a grammar
    assert len(added) == 2 * 3 + len(SAMPLING_WAYS) + 8 + 1, added
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_free_blocks == 256 and engine.kv_events.num_cached == 0
    del engine.add_request
    assert engine.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]


def test_the_decode_rate_is_measured_at_a_full_batch_and_leaves_no_trace(tiny_llama):
    """After the warm-up a GPU engine times decode steps with max_num_seqs rows (what `disagg up` sizes its routers
    by); run here on the CPU: a rate comes back, the rows were all there, and the engine is left as found."""
    from common.engine.decode_rate import TIMED_STEPS, measure_decode_rate

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=256, max_num_seqs=8))
    added = []
    add = engine.add_request
    engine.add_request = lambda request_id, *args, **kwargs: added.append(request_id) or add(request_id, *args,
                                                                                                 **kwargs)
    rate = measure_decode_rate(engine)
    assert rate is not None and rate > 0
    assert added == [f"decode-rate-{i}" for i in range(8)]
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_free_blocks == 256 and engine.kv_events.num_cached == 0
    del engine.add_request
    one_row = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=5, max_num_seqs=8))
    rows = []
    add_one = one_row.add_request
    one_row.add_request = lambda request_id, *args, **kwargs: rows.append(request_id) or add_one(request_id, *args,
                                                                                                   **kwargs)
    assert measure_decode_rate(one_row) is not None  # the pool holds one row's prompt and TIMED_STEPS tokens
    assert rows == ["decode-rate-0"] and 4 * 5 >= 8 + TIMED_STEPS + 2
    none = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=4, max_num_seqs=8))
    assert measure_decode_rate(none) is None and not none.requests  # not even one row: nothing measured

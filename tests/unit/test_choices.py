"""n > 1: one prefill, n choices sharing the prompt's full blocks; each choice its own seed stream; every block
freed on cancel. In every mode: aggregated, and context_only → generation_only."""
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import FinishReason, RequestType, SamplingParams
from common.errors import InvalidRequest

BLOCKS = 64
# On CUDA, decode steps run as graphs and are launched ahead (async scheduling), which the fork must not disturb.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]
PROMPT = torch.randint(3, 512, (19,), generator=torch.Generator().manual_seed(0)).tolist()  # 4 full blocks + 3


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def _engine(path, device="cpu", **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device=device,
                                  **{"block_size": 4, "num_kv_blocks": BLOCKS, **overrides}))


def _prompt_tokens_computed(engine: LLMEngine) -> list[int]:
    """Counts, per step, the prompt positions the model computes (patched into the runner)."""
    counted = [0]
    launch = engine.runner.launch

    def counting(batch):
        for request, n in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens
            counted[0] += max(0, min(start + n, request.num_prompt_tokens) - start)
        return launch(batch)

    engine.runner.launch = counting
    return counted


def _run(engine: LLMEngine, request_id="r", prompt=PROMPT, sampling=None, **kwargs) -> dict[int, list[int]]:
    engine.add_request(request_id, prompt, sampling, **kwargs)
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == request_id
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
    return tokens


def test_greedy_choices_equal_n1_and_the_prompt_is_computed_once(tiny_llama, device):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = _engine(tiny_llama, device)
    counted_one = _prompt_tokens_computed(one)
    (alone,) = _run(one, sampling=greedy).values()
    three = _engine(tiny_llama, device)
    counted = _prompt_tokens_computed(three)
    choices = _run(three, sampling=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=3))
    assert choices == {0: alone, 1: alone, 2: alone}
    assert counted_one[0] == len(PROMPT)
    # The leader runs the prompt; each other choice shares its 4 full blocks and computes only the 3 tokens of the
    # partial last block.
    assert counted[0] == len(PROMPT) + 2 * (len(PROMPT) % 4)
    assert three.block_manager.num_free_blocks == BLOCKS


def test_each_choice_has_its_own_seed_stream_and_choice_0_is_n1s(tiny_llama, device):
    seeded = dict(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    (alone,) = _run(_engine(tiny_llama, device), sampling=SamplingParams(**seeded)).values()
    choices = _run(_engine(tiny_llama, device), sampling=SamplingParams(**seeded, n=3))
    again = _run(_engine(tiny_llama, device), sampling=SamplingParams(**seeded, n=3))
    assert choices[0] == alone and choices == again
    assert len({tuple(c) for c in choices.values()}) == 3


def test_cancelling_frees_every_block_of_every_choice(tiny_llama, device):
    engine = _engine(tiny_llama, device)
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=4))
    for _ in range(4):
        engine.step()
    assert len(engine.requests) == 4 and engine.block_manager.num_free_blocks < BLOCKS
    assert engine.abort_request("r")
    assert not engine.requests and engine.block_manager.num_free_blocks == BLOCKS
    assert not engine.has_unfinished_requests()


def test_one_choice_can_be_cancelled_alone(tiny_llama, device):
    engine = _engine(tiny_llama, device)
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2))
    engine.step()
    assert [m.request_id for m in engine.abort_members("r#1")] == ["r#1"]
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.index for o in outputs} == {0} and outputs[-1].finish_reason is FinishReason.LENGTH
    assert engine.block_manager.num_free_blocks == BLOCKS


def test_prefill_samples_every_choice_and_decode_forks_after_one_import(tiny_llama, device):
    sampling = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, n=3)
    aggregated = _run(_engine(tiny_llama, device), sampling=sampling)
    prefill, decode = _engine(tiny_llama, device), _engine(tiny_llama, device)
    prefill.add_request("p", PROMPT, sampling, RequestType.CONTEXT_ONLY)
    outputs = []
    while prefill.has_unfinished_requests():
        outputs += prefill.step()
    firsts = {o.index: o.new_token_ids[0] for o in outputs}
    assert all(o.finish_reason is FinishReason.CONTEXT_DONE for o in outputs)
    (session,) = [o.session_id for o in outputs if o.session_id]  # one session, the leader's
    kv = prefill.export_session(session)
    prefill.release_session(session)
    assert prefill.block_manager.num_free_blocks == BLOCKS
    counted = _prompt_tokens_computed(decode)
    decoded = _run(decode, "d", sampling=sampling, request_type=RequestType.GENERATION_ONLY, kv_import=kv,
                   first_token=firsts[0], more_first_tokens=[firsts[1], firsts[2]], choices=[0, 1, 2])
    assert {i: [firsts[i]] + t for i, t in decoded.items()} == aggregated
    assert counted[0] == 2 * (len(PROMPT) % 4)  # the import is shared; the others compute their partial block
    assert decode.block_manager.num_free_blocks == BLOCKS


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 17}, r"n must be in \[1, 16\]"),
    ({"n": 0}, r"n must be in \[1, 16\]"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias has 301 entries; at most 300"),
    ({"logit_bias": {5: 101.0}}, r"biases in \[-100, 100\]"),
    ({"logit_bias": {5: "up"}}, r"biases in \[-100, 100\]"),
    ({"logit_bias": {-1: 1.0}}, r"token ids >= 0"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"prompt_logprobs": 21}, r"prompt_logprobs must be in \[0, 20\]"),
])
def test_bad_values_name_the_field_and_its_limit(kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused_and_the_engine_serves_on(tiny_llama, device):
    engine = _engine(tiny_llama, device)
    with pytest.raises(InvalidRequest, match=r"logit_bias has token ids outside the vocabulary \[0, 512\)"):
        engine.add_request("bad", PROMPT, SamplingParams(logit_bias={512: 1.0}))
    assert _run(engine, sampling=SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))


def test_prompt_logprobs_equal_hf_log_softmax_over_prefill_chunks(tiny_llama, device):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    engine = _engine(tiny_llama, device, long_prefill_token_threshold=8)  # three chunks
    engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))  # the prefix cache holds it now...
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (out,) = outputs  # ...yet every position is computed: the logprobs need their logits
    assert out.finish_reason is FinishReason.LENGTH and out.num_cached_tokens == 0
    scored = out.prompt_logprobs
    assert [lp.token_id for lp in scored] == PROMPT[1:]
    want = expected[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    assert torch.allclose(torch.tensor([lp.logprob for lp in scored]), want, atol=1e-4 if device == "cpu" else 2e-3)
    top = torch.topk(expected[:-1], 2)
    assert [[t for t, _ in lp.top] for lp in scored] == top.indices.tolist()


def test_choices_survive_preemption_and_steps_launched_ahead(tiny_llama, device):
    """A pool too small for every choice at once preempts some (they recompute, from the prefix cache where it
    holds their blocks); with async scheduling the steps after the fork are launched ahead. Greedy stays n=1's."""
    greedy = dict(temperature=0, max_tokens=14, ignore_eos=True)
    (alone,) = _run(_engine(tiny_llama, device), sampling=SamplingParams(**greedy)).values()
    engine = _engine(tiny_llama, device, num_kv_blocks=16, async_scheduling=True,  # 4 choices need 4 + 4 * 4
                     kv_growth_reserve=0)  # (admitted while blocks last)
    choices = _run(engine, sampling=SamplingParams(**greedy, n=4))
    assert choices == {i: alone for i in range(4)}
    assert engine.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 16 and not engine.requests

"""What clients send besides a prompt, through the openai SDK (and disagg.v1 gRPC for n) against `disagg up`
(prefill→decode and aggregated):
n choices from one prefill (greedy members equal n=1, streamed under their index, usage summed), penalties and
logit_bias, completions echo with the prompt's logprobs and max_tokens 0 scoring a text (lm-eval-harness's
log-likelihood request) equal to Hugging Face's log_softmax; bad values are a 400 naming the field and the next
request is served; a client that leaves an n=3 stream frees every block on every worker."""
from __future__ import annotations

import grpc
import openai
import pytest
import torch

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from common.tokenizer import Tokenizer
from tests.hf_reference import hf_model
from tests.integration.front_doors import Cluster
from tests.integration.leaks import assert_no_leaks

pytestmark = pytest.mark.slow

PROMPT = "The sea is"
USER = [{"role": "user", "content": "What is the sea?"}]


@pytest.fixture(scope="module")
def tokenizer(front_door_model) -> Tokenizer:
    return Tokenizer.from_model_dir(front_door_model)


def test_n3_greedy_choices_equal_n1_whole_and_streamed(front_doors: Cluster):
    sdk = front_doors.sdk()
    one = sdk.chat.completions.create(model=front_doors.model, messages=USER, max_tokens=12, temperature=0)
    three = sdk.chat.completions.create(model=front_doors.model, messages=USER, max_tokens=12, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    texts = {0: "", 1: "", 2: ""}
    for chunk in sdk.completions.create(model=front_doors.model, prompt=PROMPT, max_tokens=12, temperature=0, n=3,
                                        stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    alone = sdk.completions.create(model=front_doors.model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert texts == {i: alone.choices[0].text for i in range(3)}
    assert_no_leaks(front_doors.workers)


def test_n3_over_grpc_streams_each_choice_under_its_index_and_ends_each(front_doors: Cluster):
    request = generation_pb2.GenerateRequest(prompt=PROMPT, sampling=common_pb2.SamplingParams(
        temperature=0, max_tokens=6, n=3), stop=common_pb2.StopConditions(ignore_eos=True))
    with grpc.insecure_channel(front_doors.router) as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
    texts = {0: "", 1: "", 2: ""}
    for r in responses[:-1]:
        texts[r.delta.index] += r.delta.text
    finished = responses[-1].finished
    assert len(set(texts.values())) == 1 and texts[0] == front_doors.native_text(6, prompt=PROMPT)
    assert [(c.index, c.reason, c.completion_tokens) for c in finished.choices] == [
        (i, common_pb2.FINISH_REASON_LENGTH, 6) for i in range(3)]
    assert finished.usage.completion_tokens == 18


def test_seeded_choices_differ_and_choice_0_is_n1s(front_doors: Cluster):
    sdk = front_doors.sdk()
    args = dict(model=front_doors.model, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11)
    alone = sdk.completions.create(**args)
    two = sdk.completions.create(**args, n=2)
    assert two.choices[0].text == alone.choices[0].text != two.choices[1].text


def test_logit_bias_and_penalties_steer_the_tokens(front_doors: Cluster, tokenizer):
    sdk = front_doors.sdk()
    token = tokenizer.encode(" wave")[-1]
    forced = sdk.completions.create(model=front_doors.model, prompt=PROMPT, max_tokens=5, temperature=0,
                                    logit_bias={str(token): 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [tokenizer.decode([token])] * 5
    repeated = sdk.completions.create(model=front_doors.model, prompt=PROMPT, max_tokens=5, temperature=0,
                                      logit_bias={str(token): 100}, frequency_penalty=2.0, presence_penalty=2.0,
                                      logprobs=0)
    assert repeated.choices[0].logprobs.tokens == [tokenizer.decode([token])] * 5  # +100 outweighs any penalty
    penalised = sdk.completions.create(model=front_doors.model, prompt=PROMPT, max_tokens=8, temperature=0,
                                       logit_bias={str(token): 3}, frequency_penalty=2.0, logprobs=0)
    assert penalised.choices[0].logprobs.tokens.count(tokenizer.decode([token])) < 8


def test_echo_with_max_tokens_0_scores_the_prompt_as_hf(front_doors: Cluster, front_door_model, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT + " deep and blue")
    with torch.no_grad():
        logits = hf_model(front_door_model)(torch.tensor([prompt_ids])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(prompt_ids) - 1), torch.tensor(prompt_ids[1:])]
    sdk = front_doors.sdk()
    scored = sdk.completions.create(model=front_doors.model, prompt=prompt_ids, max_tokens=0, echo=True, logprobs=1,
                                    temperature=0)
    lp = scored.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(expected.tolist(), abs=1e-3)
    assert len(lp.tokens) == len(prompt_ids) and scored.usage.completion_tokens == 0
    text = sdk.completions.create(model=front_doors.model, prompt=PROMPT, max_tokens=3, echo=True, temperature=0)
    alone = sdk.completions.create(model=front_doors.model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert text.choices[0].text == PROMPT + alone.choices[0].text
    assert_no_leaks(front_doors.workers)


@pytest.mark.parametrize("extra, param", [
    ({"n": 17}, "n"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
])
def test_bad_values_are_400_naming_the_field_and_the_next_request_is_served(front_doors: Cluster, extra, param):
    sdk = front_doors.sdk()
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.completions.create(model=front_doors.model, prompt=PROMPT, max_tokens=2, extra_body=extra)
    assert param in str(refused.value)
    assert sdk.completions.create(model=front_doors.model, prompt=PROMPT, max_tokens=2).choices[0].text is not None


def test_leaving_an_n3_stream_frees_every_block_of_every_choice(front_doors: Cluster):
    stream = front_doors.sdk().completions.create(model=front_doors.model, prompt=PROMPT, max_tokens=300,
                                                  n=3, stream=True, extra_body={"ignore_eos": True})
    for _, chunk in zip(range(6), stream):
        assert chunk.choices
    stream.close()
    assert_no_leaks(front_doors.workers)

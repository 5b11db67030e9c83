"""The router's side of n > 1 and of prompt logprobs: each choice its own text, stop strings and end (a stop string
stops that choice alone), usage summed; the prompt's logprobs (first null) on each choice's first delta; max_tokens 0
scoring sends no token; the gRPC door carries index, prompt logprobs and every choice's end."""
import pytest

from common.engine.default_model import default_model_dir
from common.pb.disagg.v1 import common_pb2, generation_pb2
from services.router.decode_events import DecodeFinished, Tokens
from services.router.decode_stream import aggregated_start, handoff_start
from services.router.frontends.grpc_convert import delta_to_proto, finished_to_proto, request_from_proto
from services.router.generation import Finished, FinishReason, ServedModel, TextDelta
from services.router.prepare import RequestPreparer
from services.router.responses import ResponseBuilder

MODEL = ServedModel(name="m", max_model_len=512)


@pytest.fixture(scope="module")
def preparer() -> RequestPreparer:
    return RequestPreparer.from_model_dir(default_model_dir())


def _prepared(preparer, stop=(), **sampling):
    request = generation_pb2.GenerateRequest(prompt="Say something.", stop=common_pb2.StopConditions(stop=list(stop)),
                                             sampling=common_pb2.SamplingParams(**sampling))
    return preparer.prepare(request_from_proto(request, "r"), MODEL)


def _builder(preparer, stop=(), **sampling) -> ResponseBuilder:
    builder = ResponseBuilder("r", preparer.tokenizer)
    builder.bind(_prepared(preparer, stop, **sampling))
    return builder


def _texts(events) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events:
        if isinstance(e, TextDelta):
            texts[e.index] = texts.get(e.index, "") + e.text
    return texts


def test_a_stop_string_stops_its_choice_alone_and_usage_sums_the_choices(preparer):
    tok = preparer.tokenizer
    stopping, running = tok.encode("Hello world. More"), tok.encode("The sea is blue")
    builder = _builder(preparer, stop=["."], n=2)
    events = [builder.delta([t], index=0) for t in stopping] + [builder.delta([t], index=1) for t in running]
    assert builder.stopped_choices() == [0] and builder.stopped_choices() == []  # told once
    assert builder.live_choices() == [1] and not builder.stopped
    # The worker ends choice 0 CANCELLED (the router asked) and choice 1 by length.
    events += builder.finish(FinishReason.CANCELLED, None,
                             [(0, FinishReason.CANCELLED, None), (1, FinishReason.LENGTH, None)])
    assert _texts(events) == {0: "Hello world", 1: "The sea is blue"}
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert [(c.index, c.reason, c.matched_stop) for c in finished.choices] == [
        (0, FinishReason.STOP, "."), (1, FinishReason.LENGTH, "")]
    assert finished.usage.completion_tokens == sum(c.completion_tokens for c in finished.choices)
    proto = finished_to_proto(finished)
    assert [(c.index, c.reason) for c in proto.choices] == [(0, common_pb2.FINISH_REASON_STOP),
                                                            (1, common_pb2.FINISH_REASON_LENGTH)]


def test_prompt_logprobs_come_with_each_choices_first_delta_the_first_token_null(preparer):
    builder = _builder(preparer, n=2, prompt_logprobs=1)
    prompt = _prepared(preparer).prompt
    scored = [common_pb2.TokenLogprob(token_id=t, logprob=-1.5) for t in prompt[1:]]
    builder.prompt_scored(scored)
    first, again, other = builder.delta([5], index=0), builder.delta([6], index=0), builder.delta([7], index=1)
    assert [lp.logprob for lp in first.prompt_logprobs] == [None] + [-1.5] * (len(prompt) - 1)
    assert [lp.token_id for lp in first.prompt_logprobs] == prompt
    assert not again.prompt_logprobs and other.prompt_logprobs == first.prompt_logprobs
    proto = delta_to_proto(first)  # the wire leaves the null out: one entry per token after the first
    assert [lp.token_id for lp in proto.prompt_logprobs] == prompt[1:] and delta_to_proto(other).index == 1


def test_max_tokens_0_scores_the_prompt_and_sends_no_token(preparer):
    builder = _builder(preparer, max_tokens=0, prompt_logprobs=0)
    prompt = _prepared(preparer).prompt
    builder.prompt_scored([common_pb2.TokenLogprob(token_id=t, logprob=-2.0) for t in prompt[1:]])
    delta = builder.delta([42])  # the token the engine had to sample
    assert delta.token_ids == () and len(delta.prompt_logprobs) == len(prompt)
    assert builder.delta([43]) is None
    finished = builder.finish(FinishReason.LENGTH)[-1]
    assert finished.usage.completion_tokens == 0 and finished.reason == FinishReason.LENGTH


def test_decode_events_apply_per_choice(preparer):
    from services.router.flight import Flight
    flight = Flight(request_from_proto(generation_pb2.GenerateRequest(prompt="x"), "r"),
                    ResponseBuilder("r", preparer.tokenizer), None, lambda f: None)
    flight.bind(_prepared(preparer, n=2))
    tok = preparer.tokenizer
    events = flight.apply(Tokens(tok.encode(" one"), index=1)) + flight.apply(Tokens(tok.encode(" two"), index=0))
    events += flight.apply(DecodeFinished(FinishReason.LENGTH, None, ((0, FinishReason.LENGTH, None),
                                                                      (1, FinishReason.STOP, 2))))
    assert _texts(events) == {1: " one", 0: " two"}
    assert [(c.index, c.reason, c.matched_stop_token_id) for c in events[-1].choices] == [
        (0, FinishReason.LENGTH, None), (1, FinishReason.STOP, 2)]


def test_the_decode_start_names_each_running_choice_and_its_first_token(preparer):
    prepared = _prepared(preparer, n=3, prompt_logprobs=0)
    assert aggregated_start(prepared).sampling.n == 3
    session = common_pb2.KvSessionRef(session_id="s", first_token=9)
    start = handoff_start(prepared, 9, session, {0: 9, 2: 11})  # choice 1 ended at its first token
    assert list(start.choice_indices) == [0, 2] and start.first_token == 9 and list(start.more_first_tokens) == [11]
    assert not start.sampling.HasField("prompt_logprobs")  # prefill sent them

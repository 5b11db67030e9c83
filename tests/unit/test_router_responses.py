"""The router's side of a response: incremental text, stop strings, logprob text, usage."""
import pytest

from common.engine.default_model import default_model_dir
from common.pb.disagg.v1 import common_pb2, generation_pb2
from services.router.frontends.grpc_convert import finished_to_proto, request_from_proto
from services.router.generation import Finished, FinishReason, ServedModel, TextDelta
from services.router.prepare import RequestPreparer
from services.router.responses import ResponseBuilder

MODEL = ServedModel(name="m", max_model_len=512)


@pytest.fixture(scope="module")
def preparer() -> RequestPreparer:
    return RequestPreparer.from_model_dir(default_model_dir())


def _builder(preparer, stop=(), logprobs=False, echo=False) -> ResponseBuilder:
    request = generation_pb2.GenerateRequest(
        prompt="Say something.", stop=common_pb2.StopConditions(stop=list(stop)),
        output=common_pb2.OutputOptions(logprobs=logprobs, echo_prompt_token_ids=echo))
    builder = ResponseBuilder("r", preparer.tokenizer)
    builder.bind(preparer.prepare(request_from_proto(request, "r"), MODEL))
    return builder


def _text(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def test_text_streams_incrementally_and_finishes_with_usage(preparer):
    tok = preparer.tokenizer
    ids = tok.encode("Hello world. The sea is blue.")
    builder = _builder(preparer)
    responses = [builder.delta([t]) for t in ids]
    responses += builder.finish(FinishReason.LENGTH)
    assert _text(responses) == "Hello world. The sea is blue."
    finished = responses[-1]
    assert isinstance(finished, Finished) and finished.reason == FinishReason.LENGTH and not finished.matched_stop
    assert finished.usage.completion_tokens == len(ids)
    assert finished.usage.prompt_tokens == len(tok.encode("Say something."))
    assert 0 < finished.usage.ttft_ms <= finished.usage.e2e_ms


def test_stop_string_across_tokens_cuts_the_text_and_drops_later_tokens(preparer):
    tok = preparer.tokenizer
    ids = tok.encode("Hello world. The sea is blue.")
    builder = _builder(preparer, stop=["sea is"])
    first = builder.delta(ids[:4])
    rest = builder.delta(ids[4:])
    assert builder.stopped and builder.matched_stop == "sea is"
    assert list(rest.token_ids) == ids[4:6]  # " sea", " is": the match ends at " is"
    finished = builder.finish(FinishReason.LENGTH)
    assert _text([first, rest, *finished]) == "Hello world. The "
    assert finished[-1].reason == FinishReason.STOP
    assert finished[-1].matched_stop == "sea is"
    assert finished[-1].usage.completion_tokens == 6
    assert builder.delta(ids[6:]) is None


def test_held_back_stop_prefix_is_flushed_at_the_end(preparer):
    tok = preparer.tokenizer
    builder = _builder(preparer, stop=["blue sky"])
    ids = tok.encode("The sea is blue")
    streamed = [builder.delta([t]) for t in ids]
    assert _text(streamed) == "The sea is "  # "blue" may start "blue sky": held
    assert _text(builder.finish(FinishReason.STOP, matched_stop_token_id=2)) == "blue"


def test_logprobs_get_token_text_and_echo_sends_the_prompt_once(preparer):
    tok = preparer.tokenizer
    builder = _builder(preparer, logprobs=True, echo=True)
    ids = tok.encode("Hi there")
    lps = [common_pb2.TokenLogprob(token_id=t, logprob=-0.5, top_logprobs=[common_pb2.TopLogprob(token_id=t)])
           for t in ids]
    first, second = builder.delta(ids[:1], lps[:1]), builder.delta(ids[1:], lps[1:])
    assert [lp.text for lp in first.logprobs] == [tok.decode(ids[:1])]
    assert first.logprobs[0].top[0].text == tok.decode(ids[:1])
    assert list(first.prompt_token_ids) == tok.encode("Say something.")
    assert not second.prompt_token_ids


def test_failed_and_cancelled_carry_status_and_usage(preparer):
    from common.errors import InvalidRequest

    builder = ResponseBuilder("r", preparer.tokenizer)
    error = InvalidRequest("prompt is empty")
    failed = builder.failed(error)
    assert failed.reason == FinishReason.ERROR and failed.error is error
    assert builder.finished
    cancelled = _builder(preparer).cancelled()
    assert cancelled.reason == FinishReason.CANCELLED and cancelled.usage.prompt_tokens > 0
    # the gRPC front door carries the status code and message on the multiplexed stream
    proto = finished_to_proto(failed)
    assert (proto.error.code, proto.error.message) == (3, "prompt is empty")
    assert proto.reason == common_pb2.FINISH_REASON_ERROR

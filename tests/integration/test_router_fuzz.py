"""Property test: generated GenerateRequests (any field, weird values included) thrown at a real router over
real prefill and decode processes. The router never crashes and always answers either a valid stream
(deltas, then exactly one Finished) or a gRPC status with a message, never INTERNAL or UNKNOWN (which
would be a bug, not bad input). Afterwards it still serves, and the workers hold nothing.
It runs on the shared prefill→decode `disagg up` (conftest's front_doors): it leaves it as it found it.
"""
from __future__ import annotations

import collections

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.integration.front_doors import Cluster
from tests.integration.leaks import assert_no_leaks

pytestmark = pytest.mark.parametrize("front_doors", ["prefill-decode"], indirect=True)
VOCAB = 49152
BUG_STATUSES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
ANSWERED = {"stream": 0, "status": 0}
STATUSES: collections.Counter = collections.Counter()  # what the generated requests got, printed at the end
LOG_FROM: dict[str, int] = {}  # the shared `disagg up` log's first line of this module's requests ("line")

# Wild values: anything the wire can carry. Sane values: what a valid request may hold.
WILD = dict(
    floats=st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 0.5, 1.0])),
    ints=st.one_of(st.integers(-2**31, 2**31 - 1), st.integers(-3, 24)),
    max_tokens=st.one_of(st.integers(-3, 12), st.integers(-2**31, 2**31 - 1)),
    token_ids=st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 2**32 - 1)),
    text=st.text(max_size=400), roles=st.sampled_from(["user", "assistant", "system", "", "robot"]),
    top_logprobs=st.integers(-2**31, 2**31 - 1), model=st.sampled_from(["", "tiny-text", "gpt-9"]),
)
SANE = dict(
    floats=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]), ints=st.integers(0, 50), max_tokens=st.integers(1, 12),
    token_ids=st.integers(0, VOCAB - 1), text=st.text(min_size=1, max_size=200),
    roles=st.sampled_from(["user", "assistant", "system"]), top_logprobs=st.integers(0, 20),
    model=st.sampled_from(["", "tiny-text"]),
)


def _optional(strategy):
    return st.one_of(st.none(), strategy)


@st.composite
def sampling_params(draw, v: dict) -> common_pb2.SamplingParams:
    fields = dict(temperature=draw(_optional(v["floats"])), top_p=draw(_optional(v["floats"])),
                  top_k=draw(_optional(v["ints"])), min_p=draw(_optional(v["floats"])),
                  seed=draw(_optional(st.integers(0, 2**64 - 1) if v is WILD else st.integers(0, 2**63 - 1))),
                  repetition_penalty=draw(_optional(v["floats"])), max_tokens=draw(v["max_tokens"]))
    return common_pb2.SamplingParams(**{k: val for k, val in fields.items() if val is not None})


@st.composite
def generate_requests(draw) -> generation_pb2.GenerateRequest:
    """One request in four is wild in every field; the others are valid, so generation paths run too."""
    v = WILD if draw(st.integers(0, 3)) == 0 else SANE
    request = generation_pb2.GenerateRequest(
        request_id=draw(st.text(max_size=12)), model=draw(v["model"]), sampling=draw(sampling_params(v)),
        timeout_ms=draw(st.sampled_from([0, 0, 0, 1, 50, 5000]) if v is WILD else st.sampled_from([0, 30000])))
    kinds = ["prompt", "token_ids", "chat", "none"] if v is WILD else ["prompt", "token_ids", "chat"]
    kind = draw(st.sampled_from(kinds))
    if kind == "prompt":
        request.prompt = draw(v["text"])
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(v["token_ids"], min_size=v is SANE, max_size=300 if v is WILD else 60)))
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(v["roles"], st.text(max_size=60)),
                                           min_size=v is SANE, max_size=4)):
            request.chat.messages.add(role=role, content=content)
    if v is WILD and draw(st.integers(0, 4)) == 0:
        request.images.add(data=draw(st.binary(max_size=64)))
    request.stop.stop.extend(draw(st.lists(st.text(max_size=6, min_size=v is SANE), max_size=3)))
    request.stop.stop_token_ids.extend(draw(st.lists(v["token_ids"], max_size=3)))
    if draw(st.booleans()):
        request.stop.ignore_eos = draw(st.booleans())
    request.output.logprobs = draw(st.booleans())
    request.output.top_logprobs = draw(v["top_logprobs"])
    request.output.echo_prompt_token_ids = draw(st.booleans())
    return request


def _check_stream(responses: list[generation_pb2.GenerateResponse], request_id: str | None = None) -> str:
    """Asserts the stream is well formed; returns how it ended, for the tally."""
    assert responses, "a stream without a single response"
    assert all(r.HasField("delta") for r in responses[:-1]) and responses[-1].HasField("finished"), responses
    if request_id is not None:
        assert {r.request_id for r in responses} == {request_id}
    finished = responses[-1].finished
    if finished.reason == common_pb2.FINISH_REASON_ERROR:  # GenerateStream: a request's error rides in Finished
        assert finished.error.message, finished
        assert finished.error.code not in {c.value[0] for c in BUG_STATUSES}, finished.error
        return f"Finished with error code {finished.error.code}"
    else:
        assert finished.reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH), finished
        assert finished.usage.completion_tokens == sum(len(r.delta.token_ids) for r in responses[:-1])
        return common_pb2.FinishReason.Name(finished.reason)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(request=generate_requests(), on_stream=st.booleans())
def test_the_router_answers_every_generated_request(front_doors: Cluster, request, on_stream):
    LOG_FROM.setdefault("line", len(front_doors.up.lines))
    with grpc.insecure_channel(front_doors.router) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            if on_stream:
                request.request_id = request.request_id or "fuzz"
                responses = list(stub.GenerateStream(iter([generation_pb2.GenerateStreamRequest(start=request)]),
                                                     timeout=60))
                STATUSES[_check_stream(responses, request.request_id)] += 1
            else:
                STATUSES[_check_stream(list(stub.Generate(request, timeout=60)))] += 1
            ANSWERED["stream"] += 1
        except grpc.RpcError as error:
            assert error.code() not in BUG_STATUSES, (error.code(), error.details(), request)
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # only a request that asked for a short one
                assert request.timeout_ms and request.timeout_ms <= 50, (error.details(), request)
            assert error.details(), (error.code(), request)
            ANSWERED["status"] += 1
            STATUSES[error.code().name] += 1


def test_the_router_still_serves_and_nothing_leaked(front_doors: Cluster):
    """Runs after the property test, on the same processes."""
    print(f"\nanswers: {ANSWERED}, {dict(STATUSES)}")
    generated = STATUSES["FINISH_REASON_LENGTH"] + STATUSES["FINISH_REASON_STOP"]
    assert generated > 30 and ANSWERED["status"] > 10, STATUSES  # both generation and refusals were exercised
    with grpc.insecure_channel(front_doors.router) as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(
            prompt="The sea is", sampling=common_pb2.SamplingParams(temperature=0, max_tokens=5)), timeout=30))
    _check_stream(responses)
    assert sum(len(r.delta.token_ids) for r in responses[:-1]) == 5
    assert_no_leaks(front_doors.workers)
    # What these requests logged (the router's and workers' lines, echoed by `disagg up`): no traceback in any
    # process, and no crashed process restarted. Other modules' lines are theirs to check.
    logged = "".join(front_doors.up.lines[LOG_FROM.get("line", 0):])
    assert "Traceback" not in logged and "restarting it" not in logged, logged

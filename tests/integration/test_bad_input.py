"""Bad input of every kind against real router, prefill and decode processes: each gets the right gRPC
status and a clear message, nothing leaks, and the servers still serve a normal request correctly afterwards.

Public API: router Generate / GenerateStream (garbage bytes on the wire through a raw channel, empty and
oversized fields, invalid sampling values, unknown model, ids outside the vocabulary, non-UTF-8 stop strings,
a message over the size cap, malformed streams). Internal APIs: Prefiller.Prefill, Decoder.Decode with
malformed, forged, expired and already-pulled session refs, TensorStore.Pull / Release.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.tokenizer import Tokenizer
from common.pb.disagg.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    worker_pb2,
)
from services.kit.serving import DEFAULT_MAX_MESSAGE_BYTES
from tests.hf_reference import hf_greedy
from tests.integration.leaks import assert_no_leaks
from tests.integration.processes import ServiceProcess, start_services, stop_cleanly
from tests.integration.test_router import make_text_model
from tests.integration.worker_client import WorkerClient, split

ENV = {"OMP_NUM_THREADS": "1"}
ARGS = ("--block-size", "16", "--num-kv-blocks", "128")
SESSION_TTL_S = 2  # short, so one test can watch a session expire
PROMPT = "The sea is"
VOCAB = 49152
INVALID = grpc.StatusCode.INVALID_ARGUMENT
GENERATE = "/disagg.v1.Generation/Generate"
GENERATE_STREAM = "/disagg.v1.Generation/GenerateStream"


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> str:
    return str(make_text_model(tmp_path_factory.mktemp("models") / "tiny-text"))


@pytest.fixture(scope="module")
def cluster(text_model):
    """prefill, decode (default policy: recompute), decode with --kv-load-failure-policy fail, router."""
    workers = start_services([("prefill", ("--model", text_model, *ARGS, "--session-ttl", str(SESSION_TTL_S))),
                              ("decode", ("--model", text_model, *ARGS)),
                              ("decode", ("--model", text_model, *ARGS, "--kv-load-failure-policy", "fail"))], env=ENV)
    processes = list(workers)
    try:
        processes += start_services([("router", ("--model", text_model, "--prefill-workers", workers[0].address,
                                                 "--decode-workers", workers[1].address))], env=ENV)
        yield processes
    finally:
        stop_cleanly(processes)


@pytest.fixture(scope="module")
def tokenizer(text_model) -> Tokenizer:
    return Tokenizer.from_model_dir(text_model)


@pytest.fixture(scope="module")
def reference(text_model, tokenizer) -> list[int]:
    return hf_greedy(text_model, tokenizer.encode(PROMPT), 8, stop_at_eos=True)[0]


@pytest.fixture
def router(cluster) -> ServiceProcess:
    return cluster[3]


@pytest.fixture
def clients(cluster):
    """WorkerClients of prefill, decode, strict decode; afterwards every worker is back to its start."""
    made = [WorkerClient.connect(p) for p in cluster[:3]]
    yield made
    for client in made:
        client.channel.close()
    assert_no_leaks(cluster[:3])


def _greedy(max_tokens: int = 8, **kwargs) -> dict:
    return dict(sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens), **kwargs)


def _raises(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


# (case id, GenerateRequest kwargs, status, message substring)
ROUTER_CASES = [
    ("no-input", dict(), INVALID, "the request has no input; set one of prompt, token_ids or chat"),
    ("empty-prompt", dict(prompt=""), INVALID, "prompt is empty"),
    ("empty-token-ids", dict(token_ids=generation_pb2.TokenIds()), INVALID, "token_ids is empty"),
    ("empty-chat", dict(chat=generation_pb2.Chat()), INVALID, "chat: messages is empty"),
    ("prompt-over-context", dict(prompt="word " * 300), INVALID, "the model's context is 256 tokens"),
    ("token-id-outside-vocab", dict(token_ids=generation_pb2.TokenIds(ids=[5, VOCAB, 2**32 - 1])), INVALID,
     f"token ids outside the vocabulary [0, {VOCAB}): [{VOCAB}, 4294967295]"),
    ("unknown-model", dict(prompt=PROMPT, model="gpt-9"), grpc.StatusCode.NOT_FOUND, "unknown model 'gpt-9'"),
    ("max-tokens-0", dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=0)), INVALID,
     "max_tokens must be >= 1, got 0"),
    ("max-tokens-negative", dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=-5)), INVALID,
     "max_tokens must be >= 1, got -5"),
    ("temperature-negative", dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(temperature=-1)), INVALID,
     "temperature must be >= 0, got -1"),
    ("temperature-nan", dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(temperature=float("nan"))), INVALID,
     "temperature must be >= 0, got nan"),
    ("temperature-inf", dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(temperature=float("inf"))), INVALID,
     "temperature must be >= 0, got inf"),
    ("top-p-0", dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(top_p=0)), INVALID,
     "top_p must be in (0, 1], got 0"),
    ("top-p-over-1", dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(top_p=1.5)), INVALID,
     "top_p must be in (0, 1], got 1.5"),
    ("top-k-negative", dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(top_k=-1)), INVALID,
     "top_k must be >= 0 (0 disables it), got -1"),
    ("min-p-over-1", dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(min_p=1.5)), INVALID,
     "min_p must be in [0, 1], got 1.5"),
    ("min-p-negative", dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(min_p=-0.25)), INVALID,
     "min_p must be in [0, 1], got -0.25"),
    ("repetition-penalty-0", dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(repetition_penalty=0)), INVALID,
     "repetition_penalty must be > 0, got 0"),
    ("repetition-penalty-negative", dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(repetition_penalty=-2)),
     INVALID, "repetition_penalty must be > 0, got -2"),
    ("seed-over-int64", dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(seed=2**64 - 1)), INVALID,
     "seed must be in [0, 2^63), got 18446744073709551615"),
    ("top-logprobs-too-large", dict(prompt=PROMPT, output=common_pb2.OutputOptions(top_logprobs=21)), INVALID,
     "top_logprobs must be in [0, 20], got 21"),
    ("top-logprobs-negative", dict(prompt=PROMPT, output=common_pb2.OutputOptions(top_logprobs=-1)), INVALID,
     "top_logprobs must be >= 0, got -1"),
    ("empty-stop-string", dict(prompt=PROMPT, stop=common_pb2.StopConditions(stop=["ok", ""])), INVALID,
     "stop strings must not be empty"),
    ("stop-token-id-outside-vocab", dict(prompt=PROMPT, stop=common_pb2.StopConditions(stop_token_ids=[VOCAB + 7])),
     INVALID, f"stop_token_ids outside the vocabulary [0, {VOCAB}): [{VOCAB + 7}]"),
    ("chat-message-without-role", dict(chat=generation_pb2.Chat(messages=[generation_pb2.ChatMessage(content="hi")])),
     INVALID, "chat: messages[0] needs a role (system, user, assistant, ...)"),
]


@pytest.mark.parametrize("kwargs, code, message", [c[1:] for c in ROUTER_CASES], ids=[c[0] for c in ROUTER_CASES])
def test_bad_generate_request_gets_a_clear_status(router, kwargs, code, message):
    with router.channel() as channel:
        error = _raises(lambda: list(generation_pb2_grpc.GenerationStub(channel).Generate(
            generation_pb2.GenerateRequest(**kwargs), timeout=30)))
    assert error.code() == code and message in error.details(), (error.code(), error.details())


@pytest.mark.parametrize("method, stream", [(GENERATE, False), (GENERATE_STREAM, True)])
def test_garbage_bytes_on_the_wire(router, method, stream):
    """Not a protobuf at all: a field header announcing 2 GB of length-delimited data, then nothing."""
    garbage = b"\x1a\xff\xff\xff\xff\x07\x00garbage"
    with router.channel() as channel:
        if stream:
            call = channel.stream_stream(method)(iter([garbage]), timeout=10)
        else:
            call = channel.unary_stream(method)(garbage, timeout=10)
        error = _raises(lambda: list(call))
    assert error.code() == INVALID, error
    if stream:  # the router reads the stream itself
        assert "could not parse a GenerateStreamRequest: Error parsing message" in error.details(), error.details()
    else:  # services.kit.wire.ParseRequests
        assert ("the /disagg.v1.Generation/Generate request is not a valid message: Error parsing message with type "
                "'disagg.v1.GenerateRequest': Wire format was corrupt") in error.details(), error.details()


def test_non_utf8_stop_string_on_the_wire(router):
    valid = generation_pb2.GenerateRequest(prompt=PROMPT, stop=common_pb2.StopConditions(stop=["QQ"]), **_greedy())
    wire = valid.SerializeToString().replace(b"QQ", b"\xff\xfe")
    with router.channel() as channel:
        error = _raises(lambda: list(channel.unary_stream(GENERATE)(wire, timeout=10)))
    assert error.code() == INVALID
    assert "Error parsing message with type 'disagg.v1.GenerateRequest': String field had bad UTF-8" in error.details()


def test_message_over_the_size_cap_is_resource_exhausted(router):
    request = generation_pb2.GenerateRequest(prompt="x" * (DEFAULT_MAX_MESSAGE_BYTES + 1024))
    with grpc.insecure_channel(router.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        error = _raises(lambda: list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in error.details()


def test_a_timeout_of_one_millisecond_is_deadline_exceeded(router):
    request = generation_pb2.GenerateRequest(prompt=PROMPT, timeout_ms=1, **_greedy(200))
    with router.channel() as channel:
        error = _raises(lambda: list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30)))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline of 1 ms" in error.details()


def test_malformed_generate_streams(router):
    """Bad requests on a stream end only themselves; a message with neither start nor cancel ends the stream."""
    async def main():
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            call = stub.GenerateStream()
            for request in [generation_pb2.GenerateRequest(request_id="a", prompt=PROMPT, **_greedy(40)),
                            generation_pb2.GenerateRequest(request_id="a", prompt=PROMPT, **_greedy()),
                            generation_pb2.GenerateRequest(prompt=PROMPT),
                            generation_pb2.GenerateRequest(request_id="b", prompt=PROMPT, **_greedy(0))]:
                await call.write(generation_pb2.GenerateStreamRequest(start=request))
            await call.write(generation_pb2.GenerateStreamRequest(cancel=common_pb2.Cancel(request_id="unknown")))
            errors, finished_a = [], None
            async for response in call:
                if response.HasField("finished"):
                    if response.finished.reason == common_pb2.FINISH_REASON_ERROR:
                        errors.append((response.request_id, response.finished.error.code,
                                       response.finished.error.message))
                    else:
                        finished_a = response.finished
                if finished_a is not None and len(errors) == 3:
                    await call.done_writing()
            empty = stub.GenerateStream()
            await empty.write(generation_pb2.GenerateStreamRequest())
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in empty:
                    pass
            return errors, finished_a, info.value

    errors, finished_a, empty_error = asyncio.run(main())
    code = INVALID.value[0]
    assert sorted(errors) == [
        ("", code, "request_id is required on GenerateStream"),
        ("a", code, "request_id 'a' is already in flight on this stream; ids must be unique"),
        ("b", code, "max_tokens must be >= 1, got 0 (0 only scores a prompt, with prompt_logprobs)")]
    assert finished_a.reason == common_pb2.FINISH_REASON_LENGTH and finished_a.usage.completion_tokens == 40
    assert empty_error.code() == INVALID and "a GenerateStreamRequest must set start or cancel" in empty_error.details()


# --- internal APIs ---------------------------------------------------------------------------------------------

def _prefill(client: WorkerClient, tokenizer: Tokenizer, **fields) -> worker_pb2.PrefillResponse:
    request = worker_pb2.PrefillRequest(request_id="bad-input", token_ids=tokenizer.encode(PROMPT),
                                        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=8), **fields)
    return client.prefiller.Prefill(request, timeout=30)


def _start(prefilled: worker_pb2.PrefillResponse, tokenizer: Tokenizer) -> worker_pb2.DecodeStart:
    return worker_pb2.DecodeStart(request_id="bad-input", token_ids=tokenizer.encode(PROMPT),
                                  first_token=prefilled.first_token, session=prefilled.session,
                                  sampling=common_pb2.SamplingParams(temperature=0, max_tokens=8))


def _decode(client: WorkerClient, *messages: worker_pb2.DecodeStart | worker_pb2.DecodeClientMessage):
    wrapped = [m if isinstance(m, worker_pb2.DecodeClientMessage) else worker_pb2.DecodeClientMessage(start=m)
               for m in messages]
    return split(client.decoder.Decode(iter(wrapped), timeout=30))


@pytest.mark.parametrize("request_type, message", [
    (common_pb2.REQUEST_TYPE_GENERATION_ONLY, "Prefill runs CONTEXT_ONLY requests, got REQUEST_TYPE_GENERATION_ONLY"),
    (common_pb2.REQUEST_TYPE_CONTEXT_AND_GENERATION, "got REQUEST_TYPE_CONTEXT_AND_GENERATION"),
    (99, "Prefill runs CONTEXT_ONLY requests, got unknown request_type 99"),
])
def test_prefill_with_a_wrong_request_type(clients, tokenizer, request_type, message):
    error = _raises(lambda: _prefill(clients[0], tokenizer, request_type=request_type))
    assert error.code() == INVALID and message in error.details(), error.details()


@pytest.mark.parametrize("method, unary", [("/disagg.v1.Prefiller/Prefill", True), ("/disagg.v1.TensorStore/Pull", False),
                                           ("/disagg.v1.Worker/GetLoad", True)])
def test_garbage_bytes_to_a_worker(cluster, clients, method, unary):
    with cluster[0].channel() as channel:
        call = (channel.unary_unary if unary else channel.unary_stream)(method)
        error = _raises(lambda: call(b"\x0a\xff\xff\xff\xff\x0f", timeout=10) if unary else list(
            call(b"\x0a\xff\xff\xff\xff\x0f", timeout=10)))
    assert error.code() == INVALID, error
    assert f"the {method} request is not a valid message: Error parsing message" in error.details(), error.details()


def test_garbage_bytes_on_a_decode_stream(cluster):
    with cluster[1].channel() as channel:
        call = channel.stream_stream("/disagg.v1.Decoder/Decode")(iter([b"\x0a\xff\xff\xff\xff\x0f"]), timeout=10)
        error = _raises(lambda: list(call))
    assert error.code() == INVALID and "could not parse a DecodeClientMessage" in error.details(), error.details()


def test_prefill_with_no_tokens(clients):
    error = _raises(lambda: clients[0].prefiller.Prefill(worker_pb2.PrefillRequest(request_id="x"), timeout=30))
    assert error.code() == INVALID and "prompt is empty" in error.details()


@pytest.mark.parametrize("mutate, code, message", [
    (lambda s: s.session.ClearField("session_id"), INVALID, "the KV session ref needs a session_id and an endpoint"),
    (lambda s: s.session.ClearField("endpoint"), INVALID, "the KV session ref needs a session_id and an endpoint"),
    (lambda s: s.session.block_ids.append(9999), INVALID, "the KV session ref lists 2 blocks for"),
    (lambda s: s.ClearField("first_token"), INVALID, "a DecodeStart with a session needs first_token"),
    (lambda s: setattr(s.session, "num_layers", 7), grpc.StatusCode.FAILED_PRECONDITION, "num_layers"),
    (lambda s: setattr(s.session, "dtype", "float64"), grpc.StatusCode.FAILED_PRECONDITION, "dtype"),
    (lambda s: setattr(s, "request_type", common_pb2.REQUEST_TYPE_CONTEXT_ONLY), INVALID,
     "Decode does not run CONTEXT_ONLY requests"),
], ids=["no-session-id", "no-endpoint", "block-count", "no-first-token", "num-layers", "dtype", "context-only"])
def test_decode_with_a_malformed_session_ref(clients, tokenizer, mutate, code, message):
    prefill, decode, _ = clients
    start = _start(_prefill(prefill, tokenizer), tokenizer)
    session_id = start.session.session_id
    mutate(start)
    error = _raises(lambda: _decode(decode, start))
    assert error.code() == code and message in error.details(), error.details()
    # Decode releases a refused session it can name; one it cannot (no id or endpoint) is still ours to free.
    could_name = bool(start.session.endpoint and start.session.session_id)
    assert prefill.store.Release(worker_pb2.ReleaseRequest(handle=session_id), timeout=10).released != could_name


def test_forged_session_ref_is_recomputed_by_default_and_not_found_with_fail(clients, tokenizer, reference):
    prefill, decode, strict = clients
    start = _start(_prefill(prefill, tokenizer), tokenizer)
    real = start.session.session_id
    start.session.session_id = "forged-0123"
    tokens, finished = _decode(decode, start)  # recompute: decode runs the prompt itself
    assert [start.first_token, *tokens] == reference and finished.reason == common_pb2.FINISH_REASON_LENGTH
    error = _raises(lambda: _decode(strict, start))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "KV session forged-0123" in error.details() and "never created, or already released" in error.details()
    assert prefill.store.Release(worker_pb2.ReleaseRequest(handle=real), timeout=10).released


def test_session_pulled_twice_is_not_found_the_second_time(clients, tokenizer, reference):
    prefill, _, strict = clients
    start = _start(_prefill(prefill, tokenizer), tokenizer)
    tokens, _ = _decode(strict, start)
    assert [start.first_token, *tokens] == reference
    error = _raises(lambda: _decode(strict, start))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "already released" in error.details()
    error = _raises(lambda: list(prefill.store.Pull(worker_pb2.PullRequest(handle=start.session.session_id),
                                                    timeout=10)))
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_expired_session_ref(clients, tokenizer):
    prefill, _, strict = clients
    start = _start(_prefill(prefill, tokenizer), tokenizer)
    time.sleep(SESSION_TTL_S + 0.6)
    error = _raises(lambda: _decode(strict, start))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert f"expired after its TTL of {SESSION_TTL_S}s" in error.details(), error.details()


def test_decode_stream_protocol_errors(clients, tokenizer):
    _, decode, _ = clients
    cancel = worker_pb2.DecodeClientMessage(cancel=common_pb2.Cancel(request_id="x"))
    error = _raises(lambda: _decode(decode, cancel))
    assert error.code() == INVALID and "the first Decode message must be `start`" in error.details()
    error = _raises(lambda: _decode(decode))
    assert error.code() == INVALID and "closed before its `start` message" in error.details()
    aggregated = worker_pb2.DecodeStart(request_id="x", token_ids=tokenizer.encode(PROMPT),
                                        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=200),
                                        stop=common_pb2.StopConditions(ignore_eos=True))
    error = _raises(lambda: _decode(decode, aggregated, aggregated))
    assert error.code() == INVALID and "carries one request" in error.details()
    bad_ids = worker_pb2.DecodeStart(request_id="x", token_ids=[1, VOCAB])
    error = _raises(lambda: _decode(decode, bad_ids))
    assert error.code() == INVALID and "outside the vocabulary" in error.details()


def test_tensor_store_pull_and_release_edge_cases(clients, tokenizer):
    prefill = clients[0]
    store = prefill.store
    error = _raises(lambda: list(store.Pull(worker_pb2.PullRequest(handle="no-such-handle"), timeout=10)))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "no KV session no-such-handle" in error.details()
    error = _raises(lambda: list(store.Pull(worker_pb2.PullRequest(), timeout=10)))
    assert error.code() == INVALID and "PullRequest.handle is empty" in error.details()
    ref = _prefill(prefill, tokenizer).session
    handle, own = ref.session_id, list(ref.block_ids)
    foreign = [b for b in range(128) if b not in own][:2]
    error = _raises(lambda: list(store.Pull(worker_pb2.PullRequest(handle=handle, block_ids=[own[0], *foreign]),
                                            timeout=10)))
    assert error.code() == INVALID and f"block ids {foreign} are not in KV session {handle}" in error.details()
    whole = list(store.Pull(worker_pb2.PullRequest(handle=handle), timeout=10))
    total = whole[0].total_bytes
    assert len(whole) == 1 and len(whole[0].data) == total > 0
    tiny = list(store.Pull(worker_pb2.PullRequest(handle=handle, max_chunk_bytes=1), timeout=30))
    assert len(tiny) == total and b"".join(c.data for c in tiny) == whole[0].data
    assert [c.offset for c in tiny] == list(range(total)) and tiny[0].HasField("header")
    huge = list(store.Pull(worker_pb2.PullRequest(handle=handle, max_chunk_bytes=2**32 - 1), timeout=10))
    assert len(huge) == 1 and huge[0].data == whole[0].data  # capped at the message size, not trusted
    one = list(store.Pull(worker_pb2.PullRequest(handle=handle, block_ids=own[:1]), timeout=10))
    assert list(one[0].header.block_ids) == own[:1] and one[0].total_bytes == total // len(own)
    released = [store.Release(worker_pb2.ReleaseRequest(handle=handle), timeout=10).released for _ in range(3)]
    assert released == [True, False, False]  # idempotent
    assert not store.Release(worker_pb2.ReleaseRequest(handle="no-such-handle"), timeout=10).released
    assert not store.Release(worker_pb2.ReleaseRequest(), timeout=10).released


def test_the_servers_still_serve_correctly_afterwards(router, cluster, reference):
    """Runs last: after every bad input above, a normal request through the router matches HF."""
    with router.channel() as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(
            generation_pb2.GenerateRequest(prompt=PROMPT, **_greedy()), timeout=30))
    assert [t for r in responses if r.HasField("delta") for t in r.delta.token_ids] == reference
    assert responses[-1].finished.reason == common_pb2.FINISH_REASON_LENGTH
    assert_no_leaks(cluster[:3])

"""Prefill and decode workers as real processes on loopback: handoff, cancel, TTL, layout checks, bad input, and
many requests on one DecodeMany stream."""
from __future__ import annotations

import asyncio
import queue
import re
import signal
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Iterator

import grpc
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from common.kv.offer import DATA_PLANE_NUMBERS
from common.kv.store import pull_kv
from common.kv.wire import release_session
from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.conftest import WORKER_ENV
from tests.integration.processes import ServiceProcess, start_services, stop_in_waves
from tests.integration.worker_client import (DecodeManyClient, DecodeStream, WorkerClient, assert_pool_full, is_idle,
                                            split)

PROMPT = list(range(3, 22))  # 19 tokens: four full blocks of 4 and a partial one
GREEDY = dict(temperature=0, max_tokens=12)
SEEDED = dict(temperature=0.9, top_k=50, seed=1234, max_tokens=12)
LONG = dict(temperature=0, max_tokens=400)
NO_EOS = common_pb2.StopConditions(ignore_eos=True)
OK = grpc.StatusCode.OK.value[0]  # a DecodeMany request's `end` code


@pytest.fixture(scope="module")
def prefill(worker_pair) -> Iterator[WorkerClient]:
    client = WorkerClient.connect(worker_pair.prefill)
    yield client
    client.channel.close()


@pytest.fixture(scope="module")
def decode(worker_pair) -> Iterator[WorkerClient]:
    client = WorkerClient.connect(worker_pair.decode)
    yield client
    client.channel.close()


@pytest.fixture(autouse=True)
def every_block_returns(prefill, decode) -> Iterator[None]:
    yield
    for client in (prefill, decode):
        assert_pool_full(client)


# The tests that need a worker with flags of their own, or that stop theirs, each get one (on top of
# tiny_worker_args). They start together: a worker's start is mostly one core's imports, so one after the other,
# test by test, they left the other core idle.
OWN_WORKERS = {
    "fail_policy": ("decode", ("--kv-load-failure-policy", "fail")),
    "ttl": ("prefill", ("--session-ttl", "1")),
    "bf16": ("decode", ("--dtype", "bfloat16")),
    "one_token_steps": ("prefill", ("--max-num-batched-tokens", "1", "--num-kv-blocks", "128")),
    "sigterm": ("decode", ()),
}


@dataclass
class OwnWorkers:
    processes: list[ServiceProcess]  # conftest attaches their logs to a failed test's report

    def __getitem__(self, name: str) -> ServiceProcess:
        return self.processes[list(OWN_WORKERS).index(name)]


@pytest.fixture(scope="module")
def own_workers(tiny_worker_args) -> Iterator[OwnWorkers]:
    processes = start_services([(role, (*tiny_worker_args, *flags)) for role, flags in OWN_WORKERS.values()],
                               env=WORKER_ENV)
    try:
        yield OwnWorkers(processes)
    finally:
        stop_in_waves(processes)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=64))


def run_prefill(client: WorkerClient, prompt=PROMPT, output=None, **sampling) -> worker_pb2.PrefillResponse:
    request = worker_pb2.PrefillRequest(request_id="r", token_ids=prompt, output=output,
                                        sampling=common_pb2.SamplingParams(**sampling))
    return client.prefiller.Prefill(request, timeout=30)


def decode_start(prefilled: worker_pb2.PrefillResponse | None, prompt=PROMPT, output=None,
                 **sampling) -> worker_pb2.DecodeClientMessage:
    start = worker_pb2.DecodeStart(request_id="r", token_ids=prompt, sampling=common_pb2.SamplingParams(**sampling),
                                   stop=NO_EOS, output=output)
    if prefilled is not None:
        start.session.CopyFrom(prefilled.session)
        start.first_token = prefilled.first_token
    return worker_pb2.DecodeClientMessage(start=start)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefill_then_decode_matches_the_in_process_engine(prefill, decode, reference, sampling):
    expected = reference.generate([PROMPT], SamplingParams(**sampling, ignore_eos=True))[0]
    prefilled = run_prefill(prefill, **sampling)
    ref = prefilled.session
    assert (ref.num_tokens, len(ref.block_ids), ref.dtype, ref.first_token) == (19, 5, "float32", expected[0])
    offered = ref.attributes["transfer_backends"].split(",")  # the exporter's best backend first, grpc last
    assert ref.transfer_backend == DATA_PLANE_NUMBERS[offered[0]] and offered[-1] == "grpc"
    assert ref.expires_at_unix_ms > time.time() * 1000
    tokens, finished = split(decode.decoder.Decode(iter([decode_start(prefilled, **sampling)]), timeout=30))
    assert [prefilled.first_token, *tokens] == expected
    assert finished.reason == common_pb2.FINISH_REASON_LENGTH
    assert (finished.usage.prompt_tokens, finished.usage.completion_tokens) == (19, 11)  # prefill made the first


def test_aggregated_decode_without_a_session_matches(decode, reference):
    expected = reference.generate([PROMPT], SamplingParams(**GREEDY, ignore_eos=True))[0]
    messages = list(decode.decoder.Decode(iter([decode_start(None, **GREEDY)]), timeout=30))
    assert messages[0].delta.token_ids[0] == expected[0]
    tokens, finished = split(messages)
    assert tokens == expected and finished.usage.completion_tokens == 12


def test_logprobs_come_with_the_first_token_and_every_delta(prefill, decode):
    output = common_pb2.OutputOptions(logprobs=True, top_logprobs=2)
    prefilled = run_prefill(prefill, output=output, **GREEDY)
    assert prefilled.first_token_logprob < 0 and len(prefilled.first_token_top_logprobs) == 2
    assert prefilled.session.first_token_logprob == prefilled.first_token_logprob
    messages = list(decode.decoder.Decode(iter([decode_start(prefilled, output=output, **GREEDY)]), timeout=30))
    for message in messages[:-1]:  # a delta may hold several tokens (a stream that fell behind merges them)
        assert [lp.token_id for lp in message.delta.logprobs] == list(message.delta.token_ids)
        assert all(len(lp.top_logprobs) == 2 for lp in message.delta.logprobs)


def test_first_token_that_ends_the_request_leaves_no_session(prefill):
    prefilled = run_prefill(prefill, temperature=0, max_tokens=1)
    assert not prefilled.HasField("session") and prefilled.first_token


def test_cancel_during_decode_frees_every_block(prefill, decode):
    # The tiny model can finish all ~240 tokens its 64 blocks allow before a cancel arrives (a few
    # hundred ms); try again until the cancel lands mid-decode, which on a loaded machine is at once.
    for _ in range(5):
        stream = DecodeStream(decode, decode_start(run_prefill(prefill, **LONG), **LONG))
        try:
            deltas = [next(stream.responses) for _ in range(3)]
            stream.cancel()
            tokens, finished = split(list(stream.responses))
        finally:
            stream.close()
        assert all(m.HasField("delta") for m in deltas)  # of a token or more each (merged when the stream lags)
        assert finished.usage.completion_tokens == sum(len(m.delta.token_ids) for m in deltas) + len(tokens)
        assert is_idle(prefill.load()) and is_idle(decode.load())  # by the time `finished` arrives
        if finished.reason == common_pb2.FINISH_REASON_CANCELLED:
            break
        assert finished.reason == common_pb2.FINISH_REASON_LENGTH  # it outran the cancel
    assert finished.reason == common_pb2.FINISH_REASON_CANCELLED, "no cancel landed mid-decode in 5 tries"


def test_cancel_right_after_start_releases_the_session(prefill, decode):
    cancel = worker_pb2.DecodeClientMessage(cancel=common_pb2.Cancel(request_id="r"))
    messages = decode.decoder.Decode(iter([decode_start(run_prefill(prefill, **LONG), **LONG), cancel]), timeout=30)
    _, finished = split(messages)
    assert finished.reason == common_pb2.FINISH_REASON_CANCELLED
    assert is_idle(prefill.load()) and is_idle(decode.load())


class StallingStore(worker_pb2_grpc.TensorStoreServicer):
    """An exporter whose Pull never sends a byte: the puller must cancel, then Release."""

    def __init__(self) -> None:
        self.pulling = threading.Event()
        self.released: queue.Queue[str] = queue.Queue()

    def Pull(self, request, context):
        self.pulling.set()
        gone = threading.Event()
        context.add_callback(gone.set)
        gone.wait(30)
        yield from ()

    def Release(self, request, context):
        self.released.put(request.handle)
        return worker_pb2.ReleaseResponse(released=True)


@pytest.fixture
def stalling_store() -> Iterator[tuple[StallingStore, str]]:
    store, server = StallingStore(), grpc.server(futures.ThreadPoolExecutor(4))
    worker_pb2_grpc.add_TensorStoreServicer_to_server(store, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield store, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def fake_session(client: WorkerClient, endpoint: str) -> worker_pb2.DecodeClientMessage:
    """A session ref that fits the decode worker's layout, held by `endpoint`."""
    info = client.worker.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    prefilled = worker_pb2.PrefillResponse(first_token=7, session=common_pb2.KvSessionRef(
        session_id="fake", endpoint=endpoint, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim, block_size=info.block_size, dtype=info.dtype, fingerprint=info.fingerprint,
        num_tokens=len(PROMPT), block_ids=range(5), first_token=7))
    return decode_start(prefilled, **LONG)


def test_cancel_during_the_pull_releases_the_session(decode, stalling_store):
    store, endpoint = stalling_store
    stream = DecodeStream(decode, fake_session(decode, endpoint))
    try:
        assert store.pulling.wait(10)
        stream.cancel()
        _, finished = split(list(stream.responses))
    finally:
        stream.close()
    assert finished.reason == common_pb2.FINISH_REASON_CANCELLED
    assert store.released.get_nowait() == "fake"  # released before `finished` was sent


def _dead_endpoint() -> str:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_failed_pull_is_recomputed_by_default_and_matches(prefill, decode, reference, sampling):
    """kv_load_failure_policy=recompute (the default): the exporter is gone, decode runs the prompt itself."""
    expected = reference.generate([PROMPT], SamplingParams(**sampling, ignore_eos=True))[0]
    prefilled = run_prefill(prefill, **sampling)
    session_id = prefilled.session.session_id
    prefilled.session.endpoint = _dead_endpoint()
    try:
        tokens, finished = split(decode.decoder.Decode(iter([decode_start(prefilled, **sampling)]), timeout=30))
    finally:
        prefill.store.Release(worker_pb2.ReleaseRequest(handle=session_id), timeout=10)
    assert [prefilled.first_token, *tokens] == expected
    assert finished.reason == common_pb2.FINISH_REASON_LENGTH


def test_failed_pull_with_the_fail_policy_is_unavailable(own_workers):
    strict = WorkerClient.connect(own_workers["fail_policy"])
    endpoint = _dead_endpoint()
    with pytest.raises(grpc.RpcError) as error:
        list(strict.decoder.Decode(iter([fake_session(strict, endpoint)]), timeout=30))
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"could not pull KV session fake at {endpoint}: UNAVAILABLE" in error.value.details()
    assert_pool_full(strict)
    strict.channel.close()


def test_client_disconnect_during_decode_frees_every_block(prefill, decode):
    stream = DecodeStream(decode, decode_start(run_prefill(prefill, **LONG), **LONG))
    try:
        next(stream.responses)
        stream.responses.cancel()
        with pytest.raises(grpc.RpcError) as error:
            list(stream.responses)
    finally:
        stream.close()
    assert error.value.code() == grpc.StatusCode.CANCELLED
    assert_pool_full(decode)


def test_unpulled_session_expires_after_its_ttl(own_workers):
    process = own_workers["ttl"]
    client = WorkerClient.connect(process)
    prefilled = run_prefill(client, **GREEDY)
    load = client.load()
    assert load.active_kv_sessions == 1 and load.kv_blocks_free == load.kv_blocks_total - 5
    assert_pool_full(client, timeout_s=10)
    assert client.load().expired_kv_sessions == 1
    with pytest.raises(grpc.RpcError) as error:
        list(client.store.Pull(worker_pb2.PullRequest(handle=prefilled.session.session_id), timeout=10))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND and "expired after its TTL of 1s" in error.value.details()
    assert not client.store.Release(worker_pb2.ReleaseRequest(handle=prefilled.session.session_id)).released
    client.channel.close()
    assert process.stop() == 0


def test_decode_with_another_dtype_is_refused_naming_both_sides(prefill, own_workers):
    process = own_workers["bf16"]
    bf16 = WorkerClient.connect(process)
    with pytest.raises(grpc.RpcError) as error:
        list(bf16.decoder.Decode(iter([decode_start(run_prefill(prefill, **GREEDY), **GREEDY)]), timeout=30))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "dtype: exporter='float32' importer='bfloat16'" in error.value.details()
    assert "fingerprint: exporter=" in error.value.details()
    assert is_idle(prefill.load()) and is_idle(bf16.load())  # the refused session was released
    bf16.channel.close()


@pytest.mark.parametrize("prompt, sampling, message", [
    ([], {}, "prompt is empty"),
    ([5, 512, 7], {}, r"token ids outside the vocabulary \[0, 512\): \[512\]"),
    (PROMPT, {"temperature": -0.5}, "temperature must be >= 0"),
    (PROMPT, {"max_tokens": 0}, "max_tokens must be >= 1"),
    (list(range(3, 515)), {}, "the model's context is 512 tokens"),
])
def test_bad_prefill_request_is_invalid_argument_and_the_worker_keeps_serving(prefill, prompt, sampling, message):
    with pytest.raises(grpc.RpcError) as error:
        run_prefill(prefill, prompt, **sampling)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, error.value.details()), error.value.details()
    assert run_prefill(prefill, temperature=0, max_tokens=1).first_token


@pytest.mark.parametrize("mutate, message", [
    (lambda s: setattr(s, "first_token", s.first_token + 1), "differs from the session's"),
    (lambda s: s.token_ids.append(5), "the session holds KV for 19 tokens, the prompt has 20"),
    (lambda s: setattr(s, "request_type", common_pb2.REQUEST_TYPE_CONTEXT_AND_GENERATION), "contradicts"),
    (lambda s: setattr(s.session, "transfer_backend", 99), "KV transport 99 is not supported here"),
])
def test_bad_decode_start_is_invalid_argument_and_releases_the_session(prefill, decode, mutate, message):
    start = decode_start(run_prefill(prefill, **GREEDY), **GREEDY)
    mutate(start.start)
    with pytest.raises(grpc.RpcError) as error:
        list(decode.decoder.Decode(iter([start]), timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.value.details()
    assert is_idle(prefill.load())


def test_a_tensorrt_llm_ref_at_a_torch_decode_worker_is_failed_precondition_and_releases_the_session(prefill, decode):
    start = decode_start(run_prefill(prefill, **GREEDY), **GREEDY)
    start.start.session.transfer_backend = common_pb2.TRANSFER_BACKEND_TRTLLM
    with pytest.raises(grpc.RpcError) as error:
        list(decode.decoder.Decode(iter([start]), timeout=30))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "TRANSFER_BACKEND_TRTLLM" in error.value.details() and "--engine torch" in error.value.details()
    assert is_idle(prefill.load())


def test_decode_stream_must_begin_with_start(decode):
    cancel = worker_pb2.DecodeClientMessage(cancel=common_pb2.Cancel(request_id="r"))
    with pytest.raises(grpc.RpcError) as error:
        list(decode.decoder.Decode(iter([cancel]), timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "must be `start`" in error.value.details()


def test_pull_kv_checks_the_header_and_release_is_idempotent(prefill):
    ref = run_prefill(prefill, **GREEDY).session

    async def pull_twice():
        whole = await pull_kv(ref.endpoint, ref)
        small_chunks = await pull_kv(ref.endpoint, ref, max_chunk_bytes=1000)
        return whole, small_chunks, await release_session(ref.endpoint, ref.session_id), \
            await release_session(ref.endpoint, ref.session_id)

    whole, small_chunks, first, second = asyncio.run(pull_twice())
    assert whole.num_bytes == whole.export.layout.block_bytes() * 5 and whole.export.num_tokens == 19
    assert torch.equal(whole.export.blocks, small_chunks.export.blocks)
    assert (first.released, second.released) == (True, False)
    assert "never created, or already released" in second.reason  # says why nothing was released
    with pytest.raises(grpc.RpcError) as error:
        list(prefill.store.Pull(worker_pb2.PullRequest(handle=ref.session_id), timeout=10))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_worker_info_describes_matching_layouts(prefill, decode, worker_pair):
    infos = [c.worker.GetInfo(worker_pb2.GetInfoRequest(), timeout=10) for c in (prefill, decode)]
    assert [i.role for i in infos] == [worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE]
    assert infos[0].fingerprint == infos[1].fingerprint and infos[0].block_size == 4
    assert infos[0].limits.session_ttl_ms == 60_000 and infos[0].endpoint == worker_pair.prefill.address
    events = decode.worker.SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest(), timeout=10)
    first = next(events)  # the snapshot starts with AllCleared, numbered 1
    events.cancel()
    assert first.sequence == 1 and first.WhichOneof("event") == "cleared" and first.worker_id == infos[1].worker_id


def test_caller_leaving_mid_prefill_aborts_it_and_leaves_no_session(own_workers):
    # One token per step: a 500-token prompt takes 500 steps, ~190 ms of the tiny model on an idle 2-core machine
    # (250 took 94 ms there, under the 100 ms deadline this test had), four times the caller's 50 ms.
    process = own_workers["one_token_steps"]
    client = WorkerClient.connect(process)
    with pytest.raises(grpc.RpcError) as error:
        client.prefiller.Prefill(worker_pb2.PrefillRequest(token_ids=list(range(3, 503))), timeout=0.05)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_pool_full(client)
    client.channel.close()


def test_sigterm_lets_the_stream_in_flight_finish_then_exits_cleanly(own_workers):
    """A drain (tests/integration/test_drain.py has the rest): the request in flight runs to its end."""
    process = own_workers["sigterm"]
    client = WorkerClient.connect(process)
    stream = DecodeStream(client, decode_start(None, temperature=0, max_tokens=200))
    try:
        first = next(stream.responses)
        process.signal(signal.SIGTERM)
        tokens, finished = split([first, *stream.responses])
    finally:
        stream.close()
        client.channel.close()
    assert len(tokens) == 200 and finished.reason == common_pb2.FINISH_REASON_LENGTH
    assert process.popen.wait(30) == 0, process.log()


# Decoder.DecodeMany: many tagged requests on one stream, each one Decode's (the router's shared streams ride on it).


def test_many_requests_on_one_stream_give_decode_s_tokens_in_fewer_messages(prefill, decode):
    # Six requests side by side in the decode worker's 64 blocks of 4: 19 + 20 tokens (10 blocks) each at most, or
    # its KV growth reserve runs them one after another (one of 19 + 400 would claim the whole pool).
    side_by_side = dict(temperature=0, max_tokens=20)
    expected = split(decode.decoder.Decode(iter([decode_start(None, **side_by_side)]), timeout=60))[0]
    shared = DecodeManyClient(decode)
    tags = set(range(1, 7))
    try:
        for tag in tags:  # aggregated and handoff requests side by side
            prefilled = run_prefill(prefill, **side_by_side) if tag % 2 else None
            shared.send(tag, decode_start(prefilled, **side_by_side), timeout_s=60)
        shared.read_until_ended(tags)
    finally:
        shared.close()
    for tag in tags:
        assert shared.end_of(tag).code == OK
        tokens, finished = split(shared.messages_of(tag))
        assert tokens == (expected[1:] if tag % 2 else expected), f"tag {tag}"  # a prefill worker sampled the first
        assert finished.reason == common_pb2.FINISH_REASON_LENGTH
    deltas = sum(len(shared.messages_of(tag)) - 1 for tag in tags)
    assert shared.num_responses < deltas, "the requests' deltas did not share messages"
    assert list(shared.responses) == []  # half-closed with nothing running: the stream ends with OK


def test_a_cancel_or_a_refusal_ends_one_request_and_spares_the_others(prefill, decode):
    shared = DecodeManyClient(decode)
    try:
        shared.send(1, decode_start(run_prefill(prefill, **LONG), **LONG))
        shared.send(2, decode_start(None, **LONG))
        bad = decode_start(None, **GREEDY)
        bad.start.request_type = common_pb2.REQUEST_TYPE_GENERATION_ONLY  # without a session: refused
        shared.send(3, bad)
        shared.cancel(1)
        shared.read_until_ended({1, 2, 3})
        refused = shared.end_of(3)
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "needs a session" in refused.message
        assert shared.end_of(1).code == OK
        assert shared.messages_of(1)[-1].finished.reason == common_pb2.FINISH_REASON_CANCELLED
        assert shared.end_of(2).code == OK and split(shared.messages_of(2))[1].reason == common_pb2.FINISH_REASON_LENGTH
        del shared.by_tag[3]
        shared.send(3, decode_start(None, **GREEDY))  # an ended tag may be used again
        shared.read_until_ended({3})
        assert split(shared.messages_of(3))[1].reason == common_pb2.FINISH_REASON_LENGTH
    finally:
        shared.close()


def test_a_stream_the_client_cancels_frees_every_request_on_it(prefill, decode):
    shared = DecodeManyClient(decode)
    shared.send(1, decode_start(run_prefill(prefill, **LONG), **LONG))
    shared.send(2, decode_start(None, **LONG))
    producing: set[int] = set()
    for response in shared.responses:  # until both are running: each holds blocks when the stream goes
        producing.update(entry.tag for entry in response.messages)
        if producing >= {1, 2}:
            break
    assert producing >= {1, 2}
    shared.responses.cancel()
    shared.close()
    # every_block_returns checks both pools


def test_a_tag_started_twice_is_a_broken_stream(decode):
    shared = DecodeManyClient(decode)
    shared.send(1, decode_start(None, **LONG))
    shared.send(1, decode_start(None, **LONG))
    shared.close()
    with pytest.raises(grpc.RpcError) as raised:
        list(shared.responses)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "tag 1 already runs" in raised.value.details()


def test_an_empty_prompt_is_refused_on_its_tag(decode):
    shared = DecodeManyClient(decode)
    try:
        shared.send(5, decode_start(None, prompt=[], **GREEDY))
        shared.read_until_ended({5})
    finally:
        shared.close()
    assert shared.end_of(5).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]

"""A decode worker killed (SIGKILL) mid-stream: with --migration-limit the router moves the request to
another decode worker, which continues from the tokens delivered; the client sees HF's greedy tokens,
none lost or repeated."""
from __future__ import annotations

import signal

import grpc
import pytest

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.hf_reference import hf_greedy
from tests.integration.processes import start_services, stop_in_waves

PROMPT = list(range(3, 22))
ARGS = ("--block-size", "4", "--num-kv-blocks", "128")
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def workers(tiny_llama):
    """Both tests' workers, started together (a worker's start is mostly one core's imports): a prefill and two
    decodes for the migration test, and a decode of its own for the test without migration. Each test kills one."""
    processes = start_services([("prefill", ("--model", tiny_llama, *ARGS))] +
                               [("decode", ("--model", tiny_llama, *ARGS))] * 3, env=ENV)
    try:
        yield processes
    finally:
        stop_in_waves(processes)


@pytest.fixture
def cluster(tiny_llama, workers):
    router = start_services([("router", (
        "--model", tiny_llama, "--prefill-workers", workers[0].address, "--migration-limit", "1",
        "--decode-workers", f"{workers[1].address},{workers[2].address}"))], env=ENV)[0]
    try:
        yield [*workers[:3], router]
    finally:
        stop_in_waves([router])


def _running(process) -> int:
    with process.channel() as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5).running_requests


def test_a_request_migrates_when_its_decode_worker_dies(cluster, tiny_llama):
    prefill, decode_a, decode_b, router = cluster
    max_tokens = 200
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=PROMPT),
                                             sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
                                             stop=common_pb2.StopConditions(ignore_eos=True))
    with router.channel() as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120)
        responses = [next(call), next(call)]
        victim = decode_a if _running(decode_a) else decode_b
        survivor = decode_b if victim is decode_a else decode_a
        victim.popen.send_signal(signal.SIGKILL)
        responses += list(call)
    tokens = [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]
    finished = responses[-1].finished
    assert tokens == hf_greedy(tiny_llama, PROMPT, max_tokens)[0]
    assert finished.reason == common_pb2.FINISH_REASON_LENGTH and finished.usage.completion_tokens == max_tokens
    assert "migrating to " + survivor.address in router.log()


def test_without_migration_the_client_learns_how_many_tokens_it_got(tiny_llama, workers):
    decode = workers[3]
    processes = start_services([("router", ("--model", tiny_llama, "--decode-workers", decode.address))], env=ENV)
    try:
        request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=PROMPT),
                                                 sampling=common_pb2.SamplingParams(temperature=0, max_tokens=200),
                                                 stop=common_pb2.StopConditions(ignore_eos=True))
        delivered = 0
        with processes[-1].channel() as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
            with pytest.raises(grpc.RpcError) as info:
                for i, response in enumerate(call):
                    delivered += len(response.delta.token_ids)
                    if i == 1:
                        decode.popen.send_signal(signal.SIGKILL)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"after {delivered} tokens were delivered" in info.value.details()
    finally:
        stop_in_waves(processes)

"""Workers killed with SIGKILL at the two points DESIGN.md names, with real processes:

- the prefill worker dies after its PrefillResponse, before decode pulls the KV: decode's
  --kv-load-failure-policy recompute (the default) runs the prompt itself and matches HF greedy;
  `fail` ends the request UNAVAILABLE;
- a decode worker dies mid-stream under the router: its requests end UNAVAILABLE saying how many tokens
  were delivered, while the other requests on the same GenerateStream (on the other decode worker) finish
  with HF's tokens.
"""
from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field

import grpc
import pytest

from common.pb.disagg.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    worker_pb2,
)
from tests.hf_reference import hf_greedy
from tests.integration.leaks import assert_no_leaks
from tests.integration.processes import ServiceProcess, start_services, stop_in_waves
from tests.integration.worker_client import WorkerClient, split

PROMPT = list(range(3, 40))  # 37 tokens: ten blocks of 4
ARGS = ("--block-size", "4", "--num-kv-blocks", "256")
ENV = {"OMP_NUM_THREADS": "1"}


@dataclass
class Cluster:
    prefill: ServiceProcess
    decode_a: ServiceProcess  # with decode_b behind the router
    decode_b: ServiceProcess
    strict: ServiceProcess  # --kv-load-failure-policy fail, not behind the router
    router: ServiceProcess
    killed: list[ServiceProcess] = field(default_factory=list)

    @property
    def processes(self) -> list[ServiceProcess]:
        return [self.prefill, self.decode_a, self.decode_b, self.strict, self.router]

    def kill(self, process: ServiceProcess) -> None:
        process.signal(signal.SIGKILL)
        process.popen.wait(10)
        self.killed.append(process)


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    """One set of processes for the module (each test kills a different one): starting them is most of the time."""
    workers = start_services([("prefill", ("--model", tiny_llama, *ARGS)),
                              ("decode", ("--model", tiny_llama, *ARGS)),
                              ("decode", ("--model", tiny_llama, *ARGS)),
                              ("decode", ("--model", tiny_llama, *ARGS, "--kv-load-failure-policy", "fail"))], env=ENV)
    processes = list(workers)
    try:
        processes += start_services([("router", ("--model", tiny_llama, "--prefill-workers", workers[0].address,
                                                 "--decode-workers", f"{workers[1].address},{workers[2].address}"))],
                                    env=ENV)
        cluster = Cluster(*processes)
        yield cluster
    finally:
        codes = stop_in_waves(processes)
    for process, code in zip(processes, codes):
        if process in cluster.killed:
            assert code == -signal.SIGKILL, (process.name, code)
        else:
            assert code == 0 and "Traceback" not in process.log(), f"{process.name} exited {code}:\n{process.log()}"


async def _stream(address: str, requests: list[generation_pb2.GenerateRequest], kill) -> dict[str, list]:
    """All requests on one GenerateStream; calls `kill` once every request has had 3 responses."""
    responses: dict[str, list] = {r.request_id: [] for r in requests}
    async with grpc.aio.insecure_channel(address) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).GenerateStream(timeout=60)
        for request in requests:
            await call.write(generation_pb2.GenerateStreamRequest(start=request))
        await call.done_writing()  # the router ends the stream once every request finished
        killed = False
        async for response in call:
            responses[response.request_id].append(response)
            if not killed and all(len(rs) >= 3 for rs in responses.values()):
                await asyncio.to_thread(kill)
                killed = True
    return responses


# Runs before the prefill test below (file order), which kills the prefill worker this one needs.
def test_decode_killed_mid_stream_ends_its_requests_and_spares_the_others(cluster, tiny_llama):
    victim = cluster.decode_a
    max_tokens = 300
    requests = [generation_pb2.GenerateRequest(
        request_id=f"r{i}", token_ids=generation_pb2.TokenIds(ids=PROMPT[i:]),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
        stop=common_pb2.StopConditions(ignore_eos=True)) for i in range(4)]  # round robin: two per worker
    responses = asyncio.run(_stream(cluster.router.address, requests, lambda: cluster.kill(victim)))
    lost, served = 0, 0
    for i, request in enumerate(requests):
        got = responses[request.request_id]
        tokens = [t for r in got if r.HasField("delta") for t in r.delta.token_ids]
        assert tokens == hf_greedy(tiny_llama, PROMPT[i:], max_tokens)[0][:len(tokens)]  # never a wrong token
        finished = got[-1].finished
        assert got[-1].HasField("finished") and sum(r.HasField("finished") for r in got) == 1
        if finished.reason == common_pb2.FINISH_REASON_ERROR:
            lost += 1
            assert finished.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert f"decode worker {victim.address} failed" in finished.error.message
            assert f"after {len(tokens)} tokens were delivered" in finished.error.message
            assert 3 <= len(tokens) < max_tokens
        else:
            served += 1
            assert finished.reason == common_pb2.FINISH_REASON_LENGTH and len(tokens) == max_tokens
    assert (lost, served) == (2, 2)
    # The router serves on without the dead worker.
    with cluster.router.channel() as channel:
        after = list(generation_pb2_grpc.GenerationStub(channel).Generate(requests[0], timeout=60))
    assert [t for r in after if r.HasField("delta") for t in r.delta.token_ids] == hf_greedy(
        tiny_llama, PROMPT, max_tokens)[0]
    assert_no_leaks([cluster.prefill, cluster.decode_b])


def test_prefill_killed_between_its_answer_and_the_pull(cluster, tiny_llama):
    prefill, recompute, strict = cluster.prefill, cluster.decode_b, cluster.strict
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=16)
    with prefill.channel() as channel:
        ready = WorkerClient(channel).prefiller.Prefill(
            worker_pb2.PrefillRequest(request_id="f", token_ids=PROMPT, sampling=sampling), timeout=30)
    assert ready.HasField("session") and len(ready.session.block_ids) == 10
    cluster.kill(prefill)  # the session's blocks die with it: nobody can pull them now
    start = worker_pb2.DecodeClientMessage(start=worker_pb2.DecodeStart(
        request_id="f", token_ids=PROMPT, first_token=ready.first_token, session=ready.session,
        sampling=sampling, stop=common_pb2.StopConditions(ignore_eos=True)))
    with strict.channel() as channel, pytest.raises(grpc.RpcError) as error:
        list(WorkerClient(channel).decoder.Decode(iter([start]), timeout=30))
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"could not pull KV session {ready.session.session_id} at {prefill.address}" in error.value.details()
    with recompute.channel() as channel:
        tokens, finished = split(WorkerClient(channel).decoder.Decode(iter([start]), timeout=30))
    assert [ready.first_token, *tokens] == hf_greedy(tiny_llama, PROMPT, 16)[0]
    assert finished.reason == common_pb2.FINISH_REASON_LENGTH
    assert "recomputing its 37 prompt tokens here" in recompute.log()
    assert_no_leaks([recompute, strict])

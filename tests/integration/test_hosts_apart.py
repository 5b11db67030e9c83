"""Hosts apart, for real: router and prefill in one network namespace, a decode worker in each of two others
(benchmarks.netns: veths into one bridge, addresses of the run's own). Every KV pull crosses the bridge from the
decode's host to the prefill's; greedy output equals Hugging Face's token for token; the far decode worker killed
mid-stream leaves the router serving from the other, each request completed with HF's tokens or ended UNAVAILABLE.

Namespaces share the kernel, the machine id, the boot id and /dev/shm, so the workers' host check rightly finds one
host and `--kv-transports auto` would pull through `shm` (which works there: it is the same host). To stand for two
hosts the workers narrow to one network transport, and the test checks the pulls used it: `grpc` here; `nixl`
(UCX told to use TCP alone, UCX_TLS=tcp: left to itself it reaches a same-host peer through shared memory, and
the bytes would not cross the link) where NIXL works, skipped with NIXL's own reason elsewhere.
"""
from __future__ import annotations

import re
import signal
import subprocess
import threading

import grpc
import pytest

from benchmarks.netns import hosts_apart, netns_unavailable_reason
from common.kv.transports.nixl import nixl_unavailable_reason
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.hf_reference import hf_greedy
from tests.integration.observed import scrape
from tests.integration.processes import stop_in_waves

ENV = {"OMP_NUM_THREADS": "1", "NO_PROXY": "*", "no_proxy": "*"}
WORKER_ARGS = ("--block-size", "4", "--num-kv-blocks", "256")
PROMPTS = [list(range(3, 22)), list(range(40, 90, 3)), [7, 7, 7, 9, 11, 300, 2, 5]]


def _transports():
    nixl = nixl_unavailable_reason()
    return ["grpc", pytest.param("nixl", marks=pytest.mark.skipif(nixl is not None, reason=f"NIXL: {nixl}"))]


@pytest.fixture(scope="module", params=_transports())
def cluster(request, tiny_llama):
    """[router, prefill, far decode, other decode] and their hosts; everything stopped and torn down at the end."""
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    transport = request.param
    env = {**ENV, "UCX_TLS": "tcp"} if transport == "nixl" else ENV
    with hosts_apart(3) as net:
        near, far, other = net.hosts
        args = ("--model", tiny_llama, "--kv-transports", transport, *WORKER_ARGS)
        processes = [near.spawn("prefill", *args, env=env), far.spawn("decode", *args, env=env),
                     other.spawn("decode", *args, env=env)]
        try:
            for process in processes:
                process.wait_ready(60)
            router = near.spawn("router", "--model", tiny_llama, "--prefill-workers", processes[0].address,
                                "--decode-workers", f"{processes[1].address},{processes[2].address}",
                                "--max-local-prefill-tokens", "0", "--migration-limit", "1", env=env)
            processes.insert(0, router)
            router.wait_ready(60)
            yield transport, net, processes
        finally:
            stop_in_waves(processes)  # the killed decode's exit is -9: what the logs say is checked instead
            logs = "\n".join(p.log()[-3000:] for p in processes)
            assert not any("Traceback" in p.log() for p in processes), logs


def _request(prompt: list[int], max_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt),
                                          sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
                                          stop=common_pb2.StopConditions(ignore_eos=True))


def _generate(router, prompt: list[int], max_tokens: int) -> list[int]:
    with router.channel() as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(_request(prompt, max_tokens),
                                                                              timeout=60))
    assert responses[-1].finished.reason == common_pb2.FINISH_REASON_LENGTH, responses[-1]
    return [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]


def _pulled(decode) -> dict[str, float]:
    """{backend: bytes} this decode worker pulled."""
    found = {}
    for key, value in scrape(decode).items():
        match = re.match(r'disagg_kv_pull_bytes_total\{backend="(\w+)"', key)
        if match:
            found[match[1]] = found.get(match[1], 0) + value
    return found


def _received_bytes(host) -> int:
    """Bytes the host's veth has received: everything that reached it across the bridge."""
    stats = subprocess.run(host.command("cat", f"/sys/class/net/{host.link}/statistics/rx_bytes"),
                           capture_output=True, text=True, check=True)
    return int(stats.stdout)


def test_every_pull_crosses_hosts_and_output_equals_hf(cluster, tiny_llama):
    transport, net, (router, prefill, far, other) = cluster
    before = {d: (_pulled(d), _received_bytes(h)) for d, h in ((far, net.hosts[1]), (other, net.hosts[2]))}
    for prompt in PROMPTS * 2:  # round robin: each decode worker gets each prompt once
        assert _generate(router, prompt, 8) == hf_greedy(tiny_llama, prompt, 8)[0]
    for decode, host in ((far, net.hosts[1]), (other, net.hosts[2])):
        pulled_before, rx_before = before[decode]
        pulled = _pulled(decode)
        grew = {b: pulled[b] - pulled_before.get(b, 0) for b in pulled if pulled[b] > pulled_before.get(b, 0)}
        assert set(grew) == {transport}, f"{decode.name} pulled {grew}, expected {transport} alone"
        # What it pulled came in through its veth: its host has no other way to the prefill's.
        assert _received_bytes(host) - rx_before >= grew[transport], (host, grew)
    exported = scrape(prefill)
    assert exported.get("disagg_kv_sessions_exported_total", 0) >= len(PROMPTS) * 2, exported


def _running(decode) -> int:
    with decode.channel() as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(),
                                                           timeout=5).running_requests


def test_far_decode_killed_mid_stream_router_serves_from_the_other(cluster, tiny_llama):
    transport, net, (router, prefill, far, other) = cluster
    max_tokens = 120
    expected = {i: hf_greedy(tiny_llama, prompt, max_tokens)[0] for i, prompt in enumerate(PROMPTS * 2)}
    started = threading.Barrier(len(expected) + 1)
    outcomes: dict[int, tuple[list[int], object]] = {}

    def run(i: int) -> None:
        tokens: list[int] = []
        with router.channel() as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(_request((PROMPTS * 2)[i], max_tokens),
                                                                        timeout=90)
            try:
                for n, response in enumerate(call):
                    tokens += response.delta.token_ids
                    if n == 1:
                        started.wait(60)
                    if response.HasField("finished"):
                        outcomes[i] = (tokens, response.finished)
                        return
            except grpc.RpcError as exc:
                outcomes[i] = (tokens, exc)
                return
        outcomes[i] = (tokens, None)

    threads = [threading.Thread(target=run, args=(i,)) for i in expected]
    for thread in threads:
        thread.start()
    started.wait(60)  # every stream has its first tokens, half of them from the far worker
    assert _running(far) > 0
    far.popen.send_signal(signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    for i, (tokens, end) in outcomes.items():
        assert tokens == expected[i][:len(tokens)], f"request {i}: wrong tokens"
        if isinstance(end, grpc.RpcError):
            assert end.code() == grpc.StatusCode.UNAVAILABLE and "delivered" in end.details(), end
        else:
            assert end is not None and end.reason == common_pb2.FINISH_REASON_LENGTH, (i, end)
            assert len(tokens) == max_tokens
    assert len(outcomes) == len(expected)
    # The router goes on serving from the other host's decode worker.
    before = _pulled(other).get(transport, 0)
    for prompt in PROMPTS:
        assert _generate(router, prompt, 8) == hf_greedy(tiny_llama, prompt, 8)[0]
    assert _pulled(other).get(transport, 0) > before

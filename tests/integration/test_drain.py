"""Graceful drain (issue 23): SIGTERM on a worker or on the router loses no request.

Real processes on loopback serve a tiny random Llama with SmolLM2's tokenizer and a 2048-token context (one
request can generate for seconds). Workers log at info: a drained worker's last line, `stopped: drained in ...`,
says how many new requests still came after it turned NOT_SERVING and when the last one came, which is how
these tests see the router stop sending it work.

One cluster serves the module, its processes started at once on ports chosen beforehand: two prefill and two
decode workers and three routers. The tests use it in file order: the load test drains prefill 0 and decode 0
(--drain-timeout 20) under router 0; router 0 drains, then router 1 (--drain-timeout 1) past its timeout; decode 1
(under router 2) and prefill 1 (--drain-timeout 1) then drain past theirs.
"""
from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from dataclasses import dataclass
from typing import Iterator

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2
from common.tokenizer import Tokenizer
from tests.hf_reference import hf_greedy
from tests.integration.leaks import assert_no_leaks, load_of
from tests.integration.processes import ServiceProcess, free_port, start_services, stop_in_waves
from tests.integration.test_router import make_text_model
from tests.integration.worker_client import WorkerClient

ENV = {"OMP_NUM_THREADS": "1"}
CONTEXT = 2048
LONG_DRAIN_S, SHORT_DRAIN_S = 20.0, 1.0
PROMPTS = ["The sea is", "Once upon a time there was a lighthouse keeper who", "GPUs are fast because",
           "Bread needs flour, water and", "A drain lets every request finish before", "Seven small boats"]
MAX_TOKENS = 16
LOAD_REQUESTS, LOAD_CONCURRENCY = 200, 8
ROUTER_DRAIN_TOKENS = 1200  # seconds of generation: the refusals are checked while both streams run
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_STOPPED = re.compile(r"stopped: drained in (?P<drained>[\d.]+)s \((?:no new request came after NOT_SERVING|"
                      r"(?P<refused>\d+) new requests refused after NOT_SERVING, the last (?P<last>[\d.]+)s after it)\); "
                      r"aborted (?P<aborted>\d+) requests")


@dataclass
class Cluster:
    prefill: list[ServiceProcess]  # [0]: --drain-timeout 20, [1]: 1
    decode: list[ServiceProcess]  # the same
    routers: list[ServiceProcess]  # [0]: over all four, with HTTP; [1] (--drain-timeout 1), [2]: over the 1s
    http_url: str

    @property
    def processes(self) -> list[ServiceProcess]:
        return [*self.prefill, *self.decode, *self.routers]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> str:
    return str(make_text_model(tmp_path_factory.mktemp("models") / "tiny-text", max_position_embeddings=CONTEXT))


@pytest.fixture(scope="module")
def cluster(text_model) -> Iterator[Cluster]:
    ports = {name: free_port() for name in ("p0", "p1", "d0", "d1", "http")}
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}

    def worker(role: str, name: str, drain_s: float) -> tuple[str, tuple[str, ...]]:
        return role, ("--model", text_model, "--num-kv-blocks", "1024", "--port", str(ports[name]),
                      "--drain-timeout", str(drain_s), "--log-level", "info")

    router_args = ("--model", text_model, "--log-level", "info")
    ones = ("--prefill-workers", addr["p1"], "--decode-workers", addr["d1"])
    specs = [worker("prefill", "p0", LONG_DRAIN_S), worker("prefill", "p1", SHORT_DRAIN_S),
             worker("decode", "d0", LONG_DRAIN_S), worker("decode", "d1", SHORT_DRAIN_S),
             ("router", (*router_args, "--prefill-workers", f"{addr['p0']},{addr['p1']}",
                         "--decode-workers", f"{addr['d0']},{addr['d1']}", "--http-port", str(ports["http"]))),
             ("router", (*router_args, *ones, "--drain-timeout", str(SHORT_DRAIN_S))),
             ("router", (*router_args, *ones))]
    processes = start_services(specs, env=ENV)
    try:
        yield Cluster(processes[0:2], processes[2:4], processes[4:7], f"http://{addr['http']}")
    finally:
        stop_in_waves(processes)


def _request(prompt: str, max_tokens: int = MAX_TOKENS) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(temperature=0,
                                          max_tokens=max_tokens), stop=common_pb2.StopConditions(ignore_eos=True))


async def _generate(stub: generation_pb2_grpc.GenerationStub, request: generation_pb2.GenerateRequest,
                    ) -> tuple[list[int], str, common_pb2.Finished]:
    tokens, text, finished = [], "", None
    async for response in stub.Generate(request):
        if response.HasField("delta"):
            tokens += response.delta.token_ids
            text += response.delta.text
        else:
            finished = response.finished
    return tokens, text, finished


async def _read_rest(call: grpc.aio.UnaryStreamCall) -> list:
    """The rest of a call already read with read() (such a call cannot be iterated any more)."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


async def _not_serving(channel: grpc.aio.Channel) -> None:
    """Until the process's health (server-pushed over Watch) says NOT_SERVING."""
    async for response in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest()):
        if response.status == _NOT_SERVING:
            return


def _drain_report(process: ServiceProcess) -> re.Match:
    match = _STOPPED.search(process.log())
    assert match, f"{process.name} logged no drain summary:\n{process.log()}"
    return match


# --- scale-down under load ---

class _Load:
    """LOAD_CONCURRENCY clients sending streaming greedy requests back to back until `stop`; every outcome kept."""

    def __init__(self, stub: generation_pb2_grpc.GenerationStub):
        self.stub = stub
        self.results: list[tuple[str, list[int], str, common_pb2.Finished]] = []
        self.failures: list[str] = []
        self.stop = asyncio.Event()
        self._done = asyncio.Condition()

    async def run(self) -> None:
        await asyncio.gather(*(self._client(i) for i in range(LOAD_CONCURRENCY)))

    async def reached(self, count: int) -> None:
        async with self._done:
            await self._done.wait_for(lambda: len(self.results) + len(self.failures) >= count)

    async def _client(self, index: int) -> None:
        sent = index
        while not self.stop.is_set():
            prompt = PROMPTS[sent % len(PROMPTS)]
            sent += LOAD_CONCURRENCY
            try:
                self.results.append((prompt, *await _generate(self.stub, _request(prompt))))
            except grpc.aio.AioRpcError as exc:
                self.failures.append(f"{prompt!r}: {exc.code().name}: {exc.details()}")
            async with self._done:
                self._done.notify_all()


async def _drain_under_load(load: _Load, process: ServiceProcess, after: int) -> float:
    """Once `after` requests are done and the worker has work in flight: SIGTERM it; seconds until it exited."""
    await load.reached(after)
    while not _busy(await asyncio.to_thread(load_of, process)):
        await asyncio.sleep(0.005)  # under the load it is busy nearly always: this polls its own report
    signalled = time.monotonic()
    process.signal(signal.SIGTERM)
    code = await asyncio.to_thread(process.popen.wait, LONG_DRAIN_S + 10)
    assert code == 0, f"{process.name} exited with {code}:\n{process.log()}"
    return time.monotonic() - signalled


def _busy(load: worker_pb2.Load) -> bool:
    return bool(load.running_requests or load.waiting_requests or load.active_kv_sessions)


async def _scale_down(cluster: Cluster) -> tuple[_Load, float, float]:
    async with grpc.aio.insecure_channel(cluster.routers[0].address) as channel:
        load = _Load(generation_pb2_grpc.GenerationStub(channel))
        running = asyncio.create_task(load.run())
        decode_s = await _drain_under_load(load, cluster.decode[0], 40)
        prefill_s = await _drain_under_load(load, cluster.prefill[0], len(load.results) + 40)
        await load.reached(LOAD_REQUESTS)
        load.stop.set()
        await running
    return load, decode_s, prefill_s


def test_scale_down_under_load_drains_a_decode_then_a_prefill_worker_losing_nothing(cluster, text_model):
    tokenizer = Tokenizer.from_model_dir(text_model)
    expected = {p: hf_greedy(text_model, tokenizer.encode(p), MAX_TOKENS)[0] for p in PROMPTS}
    load, decode_s, prefill_s = asyncio.run(_scale_down(cluster))

    assert not load.failures, load.failures
    assert len(load.results) >= LOAD_REQUESTS
    texts: dict[str, str] = {}
    for prompt, tokens, text, finished in load.results:
        assert tokens == expected[prompt] and finished.reason == common_pb2.FINISH_REASON_LENGTH, (prompt, tokens)
        assert texts.setdefault(prompt, text) == text  # the same text before, during and after each drain
    for process, took_s in ((cluster.decode[0], decode_s), (cluster.prefill[0], prefill_s)):
        report = _drain_report(process)
        assert took_s < LONG_DRAIN_S and report["aborted"] == "0", report.group(0)
        assert report["refused"] is None or float(report["last"]) <= 1.0, report.group(0)  # no new work after 1 s
        assert f"worker {process.address} is not serving (NOT_SERVING)" in cluster.routers[0].log()
    assert_no_leaks([cluster.prefill[1], cluster.decode[1]])


# --- the router's own drain ---

async def _router_drain(cluster: Cluster) -> dict:
    router, prompt = cluster.routers[0], PROMPTS[1]
    completion = {"prompt": prompt, "max_tokens": ROUTER_DRAIN_TOKENS, "temperature": 0, "ignore_eos": True}
    async with grpc.aio.insecure_channel(router.address) as channel, aiohttp.ClientSession() as http:
        stub = generation_pb2_grpc.GenerationStub(channel)
        in_flight = stub.Generate(_request(prompt, ROUTER_DRAIN_TOKENS))
        first = await in_flight.read()
        sse = await http.post(f"{cluster.http_url}/v1/completions", json={**completion, "stream": True})
        first_event = await sse.content.readline()
        router.signal(signal.SIGTERM)
        await _not_serving(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _generate(stub, _request(PROMPTS[2]))
        async with http.post(f"{cluster.http_url}/v1/completions", json=completion) as http_refused:
            refused_http = (http_refused.status, await http_refused.json())
        async with http.get(f"{cluster.http_url}/health") as health:
            health_status = health.status
        responses = [first, *await _read_rest(in_flight)]
        lines = [first_event, *[line async for line in sse.content]]
        sse.release()
    events = [line.decode().strip().removeprefix("data: ") for line in lines if line.strip()]
    return {"refused": refused.value, "refused_http": refused_http, "health": health_status,
            "grpc": responses, "sse_done": events[-1] == "[DONE]", "sse": [json.loads(e) for e in events[:-1]]}


def test_router_drain_finishes_streams_in_flight_refuses_new_ones_then_exits(cluster):
    outcome = asyncio.run(_router_drain(cluster))
    router = cluster.routers[0]
    assert router.popen.wait(30) == 0, router.log()
    assert outcome["refused"].code() == grpc.StatusCode.UNAVAILABLE and "draining" in outcome["refused"].details()
    status, body = outcome["refused_http"]
    assert status == 503 and "draining" in body["error"]["message"], body
    assert outcome["health"] == 503
    tokens = [t for r in outcome["grpc"] if r.HasField("delta") for t in r.delta.token_ids]
    assert len(tokens) == ROUTER_DRAIN_TOKENS
    assert outcome["grpc"][-1].finished.reason == common_pb2.FINISH_REASON_LENGTH
    choices = [event["choices"][0] for event in outcome["sse"]]
    assert outcome["sse_done"] and choices[-1]["finish_reason"] == "length"
    grpc_text = "".join(r.delta.text for r in outcome["grpc"] if r.HasField("delta"))
    assert "".join(c["text"] for c in choices) == grpc_text  # both streams whole: the same greedy text
    assert "Traceback" not in router.log(), router.log()
    assert_no_leaks([cluster.prefill[1], cluster.decode[1]])


# --- past --drain-timeout ---

def test_a_router_drain_past_its_timeout_ends_streams_with_unavailable_naming_it(cluster):
    router = cluster.routers[1]

    async def scenario() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(router.address) as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(_request(PROMPTS[1], CONTEXT - 32))
            await call.read()
            router.signal(signal.SIGTERM)
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await _read_rest(call)
            return ended.value

    ended = asyncio.run(scenario())
    assert router.popen.wait(10) == 0, router.log()
    assert ended.code() == grpc.StatusCode.UNAVAILABLE, ended
    assert ended.details() == f"router {router.address} draining: --drain-timeout 1s passed; retry the request"
    assert_no_leaks([cluster.prefill[1], cluster.decode[1]])  # its worker calls were cancelled: their KV freed


def test_a_decode_drain_past_its_timeout_ends_requests_with_unavailable_naming_it(cluster):
    decode, router = cluster.decode[1], cluster.routers[2]

    async def scenario() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(router.address) as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(_request(PROMPTS[1], CONTEXT - 32))
            await call.read()  # prefill's first token
            await call.read()  # decode's: generating, with seconds of tokens left, far more than the 1 s drain
            decode.signal(signal.SIGTERM)
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await _read_rest(call)
            return ended.value

    ended = asyncio.run(scenario())
    assert decode.popen.wait(10) == 0, decode.log()
    assert ended.code() == grpc.StatusCode.UNAVAILABLE, ended
    assert f"decode worker {decode.address} draining: --drain-timeout 1s passed; retry the request" in ended.details()
    assert "aborted 1 requests" in decode.log(), decode.log()
    assert_no_leaks([cluster.prefill[1]])


def test_a_draining_prefill_worker_serves_its_sessions_refuses_new_prompts_and_frees_the_rest(cluster, text_model):
    prefill = cluster.prefill[1]
    client = WorkerClient.connect(prefill)
    prompt = Tokenizer.from_model_dir(text_model).encode(PROMPTS[1])
    refs = [client.prefiller.Prefill(worker_pb2.PrefillRequest(request_id=f"held-{i}", token_ids=prompt),
                                     timeout=10).session for i in range(2)]
    try:
        prefill.signal(signal.SIGTERM)
        signalled = time.monotonic()
        asyncio.run(_watch_until_not_serving(prefill))
        with pytest.raises(grpc.RpcError) as refused:
            client.prefiller.Prefill(worker_pb2.PrefillRequest(request_id="new", token_ids=prompt), timeout=10)
        chunks = list(client.store.Pull(worker_pb2.PullRequest(handle=refs[0].session_id), timeout=10))
        released = client.store.Release(worker_pb2.ReleaseRequest(handle=refs[0].session_id), timeout=10)
    finally:
        client.channel.close()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"prefill worker {prefill.address} is draining and takes no new requests" in refused.value.details()
    header = chunks[0].header
    assert list(header.block_ids) == list(refs[0].block_ids) and header.fingerprint == refs[0].fingerprint
    assert sum(len(c.data) for c in chunks) == chunks[0].total_bytes > 0 and released.released
    assert prefill.popen.wait(10) == 0, prefill.log()
    assert time.monotonic() - signalled >= SHORT_DRAIN_S  # it kept the unpulled session until its drain ran out
    assert "held for pulls; ending them" in prefill.log() and "released 1 KV sessions" in prefill.log()


async def _watch_until_not_serving(process: ServiceProcess) -> None:
    async with grpc.aio.insecure_channel(process.address) as channel:
        await _not_serving(channel)

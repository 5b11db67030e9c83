"""Issue #23: a normal run logs no ERROR and no traceback. A mixed workload goes through `disagg up` prefill→decode
and aggregated (`--prefill 0`) with the tiny LLaVA model, every process exporting traces to a real OTLP receiver:
streams, client cancels (an RPC cancelled, a Cancel on GenerateStream), stop strings, deadlines (timeout_ms and
the RPC's own), the OpenAI door (whole, streamed, and a client that walks away mid-stream), and an image request
through an encode worker and a router beside each `disagg up` (which starts none). Then everything stops, and no
process may have logged an ERROR, a traceback, or one of asyncio's and OpenTelemetry's complaints (each of those
was seen in a normal run: "Task was destroyed but it is pending!", "Task exception was never retrieved",
"aclose(): asynchronous generator is already running", "Failed to detach context", "Setting attribute on ended
span", and triton's "nanobind: leaked ..." at exit once start-up objects were frozen)."""
from __future__ import annotations

import queue
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.integration.front_doors import WORKER_LINE
from tests.integration.observed import wait_for
from tests.integration.processes import ServiceProcess, free_port, start_services, stop_in_waves
from tests.integration.test_up import Up
from benchmarks.tiny_llava import make_tiny_llava, png_bytes

pytestmark = pytest.mark.slow

BAD = re.compile(r"\bERROR\b|\bCRITICAL\b|Traceback|Task was destroyed|never retrieved|Failed to detach|ended span"
                 r"|Exception ignored|already running|nanobind: leaked")
LONG = dict(sampling=common_pb2.SamplingParams(temperature=0, max_tokens=400),
            stop=common_pb2.StopConditions(ignore_eos=True))  # runs until cancelled or out of time


def _request(prompt: str, max_tokens: int = 12, **fields) -> generation_pb2.GenerateRequest:
    fields.setdefault("sampling", common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))
    return generation_pb2.GenerateRequest(prompt=prompt, **fields)


def _text(responses) -> tuple[str, common_pb2.Finished]:
    responses = list(responses)
    return "".join(r.delta.text for r in responses if r.HasField("delta")), responses[-1].finished


def _streams_and_stop_strings(stub: generation_pb2_grpc.GenerationStub) -> None:
    prompts = [f"Story {i}: the lighthouse" for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda p: _text(stub.Generate(_request(p), timeout=30)), prompts))
    assert all(finished.reason for _, finished in texts), texts
    text = texts[0][0]
    stop = text[len(text) // 2:][:3]
    stopped, finished = _text(stub.Generate(_request(prompts[0], stop=common_pb2.StopConditions(stop=[stop])),
                                            timeout=30))
    assert stopped == text[:text.index(stop)] and finished.reason == common_pb2.FINISH_REASON_STOP, (stopped, stop)


def _cancel_rpc(stub: generation_pb2_grpc.GenerationStub) -> None:
    call = stub.Generate(_request("Cancelled by the client", **LONG), timeout=30)
    next(call)
    call.cancel()


def _cancel_on_stream(stub: generation_pb2_grpc.GenerationStub) -> None:
    requests: queue.Queue = queue.Queue()
    requests.put(generation_pb2.GenerateStreamRequest(start=_request("Cancelled on the stream", request_id="c1",
                                                                     **LONG)))
    stream = stub.GenerateStream(iter(requests.get, None), timeout=30)
    next(stream)
    requests.put(generation_pb2.GenerateStreamRequest(cancel=common_pb2.Cancel(request_id="c1")))
    last = next(r for r in stream if r.HasField("finished"))
    requests.put(None)  # half-close: the stream ends once its requests have
    assert last.finished.reason == common_pb2.FINISH_REASON_CANCELLED and not list(stream), last


def _deadlines(stub: generation_pb2_grpc.GenerationStub) -> None:
    for kwargs, timeout in (({"timeout_ms": 300}, 30), ({}, 0.3)):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(_request("Out of time", **LONG, **kwargs), timeout=timeout))
        assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, info.value


def _openai(http: str) -> None:
    sdk = openai.OpenAI(base_url=f"{http}/v1", api_key="unused", max_retries=0, timeout=30)
    model = sdk.models.list().data[0].id
    whole = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8)
    assert whole.choices[0].finish_reason in ("length", "stop")
    chunks = list(sdk.completions.create(model=model, prompt="The sea is", max_tokens=8, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    walked = sdk.completions.create(model=model, prompt="Walk away", max_tokens=400, stream=True,
                                    extra_body={"ignore_eos": True})
    next(iter(walked))
    walked.close()  # the client leaves mid-stream


def _workload(router: str, http: str) -> None:
    with grpc.insecure_channel(router) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        _streams_and_stop_strings(stub)
        _cancel_rpc(stub)
        _cancel_on_stream(stub)
        _deadlines(stub)
    _openai(http)


def _image(router: ServiceProcess) -> None:
    request = generation_pb2.GenerateRequest(prompt="<image>\nWhat is it?", images=[common_pb2.Image(data=png_bytes(3))],
                                             sampling=common_pb2.SamplingParams(temperature=0, max_tokens=6),
                                             stop=common_pb2.StopConditions(ignore_eos=True))
    with router.channel() as channel:
        _, finished = _text(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30))
    assert finished.usage.completion_tokens == 6, finished


def _start_ups(model: str, env: dict[str, str]) -> list[tuple[Up, str]]:
    """`disagg up` prefill→decode and aggregated, loading in parallel: (up, its OpenAI URL) each."""
    ups = []
    for mode in ((), ("--prefill", "0")):
        http = free_port()
        ups.append((Up("--model", model, "--router-port", "0", "--http-port", str(http), *mode, env=env),
                    f"http://127.0.0.1:{http}"))
    return ups


def _image_routers(model: str, ups: list[tuple[Up, str]], encode: ServiceProcess,
                   env: dict[str, str]) -> list[ServiceProcess]:
    """A router with the encode worker over each `disagg up`'s workers (up has no encode worker)."""
    workers = [dict((name.split("-")[0], address) for name, address in WORKER_LINE.findall("".join(up.lines)))
               for up, _ in ups]
    return start_services([("router", ("--model", model, "--encode-workers", encode.address,
                                       *(arg for role, address in found.items()
                                         for arg in (f"--{role}-workers", address))))
                           for found in workers], env=env)


def _stop_all(ups: list[tuple[Up, str]], others: list[ServiceProcess]) -> list[int]:
    """Both `disagg up`s and the image routers (then the encode worker) at once: each waits about a second a wave
    for its processes to stop, and one after the other those waits added up to seconds."""
    with ThreadPoolExecutor(len(ups) + 1) as pool:
        up_codes = [pool.submit(up.stop) for up, _ in ups]
        other_codes = pool.submit(stop_in_waves, others)
        return [code.result() for code in up_codes] + other_codes.result()


def _bad_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if BAD.search(line)]


def test_a_normal_mixed_run_logs_no_error_and_no_traceback(tmp_path, receiver):
    env = {"OMP_NUM_THREADS": "1", **receiver.export_env}
    model = str(make_tiny_llava(tmp_path / "llava"))
    ups = _start_ups(model, env)
    others = [ServiceProcess.spawn("encode", "--model", model, env=env)]  # it loads while the ups start
    try:
        for up, _ in ups:
            up.wait()
        others[0].wait_ready()
        others += _image_routers(model, ups, others[0], env)
        for router in others[1:]:
            _image(router)
        for up, http in ups:
            _workload(up.router, http)
        wait_for(lambda: {"disagg-router", "disagg-prefill", "disagg-decode", "disagg-encode"}
                 <= {s.service for s in receiver.spans} or None, 20, "spans from every kind of service")
    finally:
        codes = _stop_all(ups, others)
    logs = {" ".join(up.popen.args[3:]): "".join(up.lines) for up, _ in ups} | {p.name: p.log() for p in others}
    assert codes == [0] * len(codes), logs
    bad = {name: lines for name, log in logs.items() if (lines := _bad_lines(log))}
    assert not bad, "\n\n".join(f"{name}:\n{log}" for name, log in logs.items() if name in bad)

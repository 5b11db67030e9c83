"""The router over real prefill and decode processes on loopback: parity with HF, cancels, errors, limits.

One prefill and one decode worker serve a tiny random Llama whose vocabulary is SmolLM2's, with
SmolLM2's tokenizer files next to it, so text requests work; several routers share them. The workers are the shared
prefill→decode `disagg up`'s (conftest's front_doors); the routers here are this module's own.
"""
from __future__ import annotations

import asyncio
import json
import re
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import grpc
import pytest

from benchmarks.text_model import make_text_model  # noqa: F401 (the tests import it from here)
from common.tokenizer import Tokenizer
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.hf_reference import hf_greedy
from tests.integration.leaks import assert_no_leaks
from tests.integration.processes import ServiceProcess, start_service, stop_cleanly

if TYPE_CHECKING:  # front_doors imports make_text_model from here
    from tests.integration.front_doors import Cluster, Worker

PROMPTS = ["The sea is", "Once upon a time there was a lighthouse keeper who", "GPUs are fast because",
           "Bread needs flour, water and"]
MAX_TOKENS = 12


pytestmark = pytest.mark.parametrize("front_doors", ["prefill-decode"], indirect=True)


@pytest.fixture(scope="module")
def text_model(front_door_model) -> str:
    """front_doors' model. The deadline tests run a request to the end of the context: 256 positions took about 0.4 s
    on an idle machine, the deadline itself, so the request sometimes finished first; its 8192 take many seconds."""
    return front_door_model


@pytest.fixture(scope="module")
def tokenizer(text_model) -> Tokenizer:
    return Tokenizer.from_model_dir(text_model)


@pytest.fixture(scope="module")
def workers(front_doors: Cluster) -> Iterator[list[Worker]]:
    """[prefill, decode]; afterwards, what they logged over this module's tests (echoed by `disagg up`) has no
    traceback and no restart, as stop_cleanly checked of this module's own workers before they were shared."""
    start = len(front_doors.up.lines)
    yield front_doors.workers
    logged = "".join(front_doors.up.lines[start:])
    assert "Traceback" not in logged and "restarting it" not in logged, logged


def _router(model: str, prefill: list, decode: list, *flags: str) -> ServiceProcess:
    """A router of its own over `prefill` and `decode` (ServiceProcess or Worker: anything with an address)."""
    args = ["--model", model, "--decode-workers", ",".join(p.address for p in decode), *flags]
    if prefill:
        args += ["--prefill-workers", ",".join(p.address for p in prefill)]
    return start_service("router", *args)


@pytest.fixture(scope="module", autouse=True)
def decode_bf16(text_model) -> Iterator[ServiceProcess]:
    """A bfloat16 decode for the fingerprint test, spawned as the module starts so that it loads while the tests
    before that one run (a worker's start is about 5 s of one core's imports); that test waits until it serves."""
    process = ServiceProcess.spawn("decode", "--model", text_model, "--dtype", "bfloat16", "--num-kv-blocks", "64")
    try:
        yield process
    finally:
        if process.address is None:  # still loading (that test was not run): stopped, not judged
            process.stop()
        else:
            stop_cleanly([process])


@pytest.fixture(scope="module")
def router(text_model, workers):
    """Every prompt goes prefill → decode."""
    process = _router(text_model, workers[:1], workers[1:])
    yield process
    stop_cleanly([process])


@pytest.fixture(scope="module")
def per_request_router(text_model, workers):
    """As `router`, with a Decode stream per request instead of the shared DecodeMany stream to the decode worker."""
    process = _router(text_model, workers[:1], workers[1:], "--decode-streams", "per-request")
    yield process
    stop_cleanly([process])


@pytest.fixture(scope="module")
def aggregated_router(text_model, workers):
    """Every prompt runs aggregated on the decode worker; at most 4 requests in flight."""
    process = _router(text_model, workers[:1], workers[1:], "--min-remote-prefill-tokens", "100000",
                      "--max-inflight-requests", "4", "--policy", "least_loaded")
    yield process
    stop_cleanly([process])


def _stub(process: ServiceProcess) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(process.address))


def _greedy(max_tokens: int = MAX_TOKENS, **stop) -> dict:
    return dict(sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
                stop=common_pb2.StopConditions(**stop))


def _to_the_context() -> dict:
    """Greedy with no max_tokens, ignoring EOS: runs to the end of the context (a max_tokens past it is refused)."""
    return dict(sampling=common_pb2.SamplingParams(temperature=0), stop=common_pb2.StopConditions(ignore_eos=True))


def _collect(responses) -> tuple[list[int], str, common_pb2.Finished]:
    tokens, text, finished = [], "", None
    for response in responses:
        if response.HasField("delta"):
            tokens += response.delta.token_ids
            text += response.delta.text
        else:
            finished = response.finished
    return tokens, text, finished


def _reference(model: str, tokenizer: Tokenizer, prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    return hf_greedy(model, tokenizer.encode(prompt), max_tokens, stop_at_eos=True)[0]


@pytest.mark.parametrize("which", ["router", "aggregated_router", "per_request_router"])
def test_greedy_text_matches_hf_generate(request, which, text_model, tokenizer, workers):
    stub = _stub(request.getfixturevalue(which))
    for prompt in PROMPTS:
        tokens, text, finished = _collect(stub.Generate(generation_pb2.GenerateRequest(prompt=prompt, **_greedy())))
        expected = _reference(text_model, tokenizer, prompt)
        assert tokens == expected, prompt
        assert text == tokenizer.decode(expected)
        assert finished.reason == common_pb2.FINISH_REASON_LENGTH
        usage = finished.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(tokenizer.encode(prompt)), MAX_TOKENS)
        assert 0 < usage.ttft_ms <= usage.e2e_ms
        # The client sees how the prompt's KV reached decode (none moved when aggregated).
        handed_off = which != "aggregated_router"
        assert (usage.kv_transfer_backend != common_pb2.TRANSFER_BACKEND_UNSPECIFIED) == handed_off
        assert (usage.kv_transfer_bytes > 0) == handed_off
    assert_no_leaks(workers)


def test_chat_input_uses_the_chat_template(router, text_model, tokenizer):
    chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content="Hi!")])
    tokens, _, _ = _collect(_stub(router).Generate(generation_pb2.GenerateRequest(chat=chat, **_greedy())))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert tokens == hf_greedy(text_model, prompt, MAX_TOKENS, stop_at_eos=True)[0]


def test_stop_string_finishes_stop_and_frees_the_decode(router, text_model, tokenizer, workers):
    expected = _reference(text_model, tokenizer, PROMPTS[1])
    full = tokenizer.decode(expected)
    stop = full[len(tokenizer.decode(expected[:5])):][:6]  # text that starts with the 6th token
    request = generation_pb2.GenerateRequest(prompt=PROMPTS[1], **_greedy(stop=[stop]))
    tokens, text, finished = _collect(_stub(router).Generate(request))
    assert finished.reason == common_pb2.FINISH_REASON_STOP and finished.matched_stop == stop
    assert text == full[: full.index(stop)]
    assert tokens == expected[: len(tokens)] and len(tokens) < MAX_TOKENS
    assert_no_leaks(workers)


def test_stop_string_across_tokens_cancels_the_decode_worker_before_finished(router, tokenizer, workers):
    """The worker never sees the stop string: the router matches it and cancels the worker's request,
    whose blocks are free when the client gets Finished (not when the worker would have reached max_tokens)."""
    prompt, ignore_eos = PROMPTS[2], common_pb2.StopConditions(ignore_eos=True)
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=16)
    reference, full, _ = _collect(_stub(router).Generate(generation_pb2.GenerateRequest(
        prompt=prompt, sampling=sampling, stop=ignore_eos)))
    pieces = [tokenizer.decode(reference[:i]) for i in range(len(reference) + 1)]
    cut = next(i for i in range(3, len(reference)) if len(pieces[i + 1]) - len(pieces[i]) >= 2)
    stop = full[len(pieces[cut]) - 1:len(pieces[cut]) + 2]  # the end of one token and the start of the next
    request = generation_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(
        temperature=0, max_tokens=200), stop=common_pb2.StopConditions(stop=[stop], ignore_eos=True))
    with workers[1].channel() as channel:
        decode_worker = worker_pb2_grpc.WorkerStub(channel)
        decode_worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)  # the channel is connected
        responses = []
        for response in _stub(router).Generate(request):
            responses.append(response)
            if response.HasField("finished"):  # at once, no polling: the cancel was confirmed before Finished
                decode = decode_worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    tokens, text, finished = _collect(responses)
    assert finished.reason == common_pb2.FINISH_REASON_STOP and finished.matched_stop == stop
    assert text == full[: full.index(stop)] and tokens == reference[: len(tokens)]
    assert decode.kv_blocks_free == decode.kv_blocks_total and decode.running_requests == 0
    assert finished.usage.kv_transfer_bytes > 0  # from the worker's Finished, which confirmed the cancel
    assert_no_leaks(workers)


def test_first_token_that_ends_the_request_skips_decode_and_frees_the_session(router, text_model, tokenizer,
                                                                              workers):
    first = _reference(text_model, tokenizer, PROMPTS[0], 1)[0]
    stub = _stub(router)
    tokens, _, finished = _collect(stub.Generate(generation_pb2.GenerateRequest(prompt=PROMPTS[0], **_greedy(1))))
    assert tokens == [first] and finished.reason == common_pb2.FINISH_REASON_LENGTH
    # Prefill does not know stop token ids: it exports a session the router must release.
    request = generation_pb2.GenerateRequest(prompt=PROMPTS[0], **_greedy(stop_token_ids=[first]))
    tokens, _, finished = _collect(stub.Generate(request))
    assert tokens == [first] and finished.reason == common_pb2.FINISH_REASON_STOP
    assert finished.matched_stop_token_id == first
    assert_no_leaks(workers)


def test_token_ids_input_with_logprobs_and_echo(router, text_model, workers):
    ids = [1, 400, 500, 600, 700]
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), **_greedy(4),
                                             output=common_pb2.OutputOptions(logprobs=True,
                                                                             echo_prompt_token_ids=True))
    responses = list(_stub(router).Generate(request))
    deltas = [r.delta for r in responses if r.HasField("delta")]
    expected, logprobs = hf_greedy(text_model, ids, 4, stop_at_eos=True)
    assert list(deltas[0].prompt_token_ids) == ids and not any(d.prompt_token_ids for d in deltas[1:])
    got = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in got] == expected
    assert [lp.logprob for lp in got] == pytest.approx(logprobs, abs=1e-3)
    assert all(lp.text for lp in got)


async def _stream_with_cancels(address: str, requests: list[generation_pb2.GenerateRequest],
                               cancel_at_once: set[str], cancel_after_first: set[str]) -> dict[str, list]:
    """Run every request on one GenerateStream; returns each request's responses."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).GenerateStream()
        for request in requests:
            await call.write(generation_pb2.GenerateStreamRequest(start=request))
            if request.request_id in cancel_at_once:
                await call.write(generation_pb2.GenerateStreamRequest(
                    cancel=common_pb2.Cancel(request_id=request.request_id)))
        responses: dict[str, list] = {r.request_id: [] for r in requests}
        finished = 0
        async for response in call:
            responses[response.request_id].append(response)
            if response.request_id in cancel_after_first and response.HasField("delta"):
                cancel_after_first.discard(response.request_id)
                await call.write(generation_pb2.GenerateStreamRequest(
                    cancel=common_pb2.Cancel(request_id=response.request_id)))
            finished += response.HasField("finished")
            if finished == len(requests):
                await call.done_writing()  # the router ends the stream once it has seen the half-close
    return responses


@pytest.mark.parametrize("which", ["router", "per_request_router"])
def test_many_requests_on_one_stream_with_cancels_all_finish_and_free_every_block(request, which, text_model,
                                                                                   tokenizer, workers):
    router = request.getfixturevalue(which)
    requests, cancel_at_once, cancel_after_first = [], set(), set()
    for i in range(24):
        rid = f"req-{i}"
        if i % 6 == 1:
            cancel_at_once.add(rid)
        elif i % 6 == 4:
            cancel_after_first.add(rid)
        long = rid in cancel_at_once or rid in cancel_after_first
        requests.append(generation_pb2.GenerateRequest(
            request_id=rid, prompt=PROMPTS[i % len(PROMPTS)],
            **(_greedy(200, ignore_eos=True) if long else _greedy())))
    cancelled = cancel_at_once | cancel_after_first
    responses = asyncio.run(_stream_with_cancels(router.address, requests, set(cancel_at_once),
                                                 set(cancel_after_first)))
    references = {p: _reference(text_model, tokenizer, p) for p in PROMPTS}
    for request in requests:
        tokens, text, finished = _collect(responses[request.request_id])
        assert finished is not None and [r.HasField("finished") for r in responses[request.request_id]][-1]
        if request.request_id in cancelled:
            assert finished.reason == common_pb2.FINISH_REASON_CANCELLED, request.request_id
            assert len(tokens) < 200 and finished.usage.completion_tokens == len(tokens)
        else:
            assert tokens == references[request.prompt], request.request_id
            assert text == tokenizer.decode(tokens)
    assert_no_leaks(workers)


def test_client_disconnect_mid_stream_frees_every_block(router, workers):
    request = generation_pb2.GenerateRequest(prompt=PROMPTS[1], **_greedy(200, ignore_eos=True))
    call = _stub(router).Generate(request)
    assert next(call).HasField("delta") and next(call).HasField("delta")
    call.cancel()
    assert_no_leaks(workers)


def test_bad_requests_get_clear_statuses_and_the_router_keeps_serving(router, workers, text_model):
    stub = _stub(router)
    context = json.loads((Path(text_model) / "config.json").read_text())["max_position_embeddings"]
    cases = [
        (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        (dict(prompt="word " * (context + 100)), grpc.StatusCode.INVALID_ARGUMENT,
         f"the model's context is {context} tokens"),
        (dict(prompt="x", sampling=common_pb2.SamplingParams(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT,
         "max_tokens must be >= 1, got 0"),
        (dict(prompt="x", sampling=common_pb2.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT,
         "temperature must be >= 0, got -1"),
        (dict(prompt="x", sampling=common_pb2.SamplingParams(top_p=0)), grpc.StatusCode.INVALID_ARGUMENT,
         "top_p must be in (0, 1], got 0"),
        (dict(prompt="x", sampling=common_pb2.SamplingParams(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT,
         "top_p must be in (0, 1], got 1.5"),
        (dict(prompt="x", model="gpt-9"), grpc.StatusCode.NOT_FOUND, "unknown model 'gpt-9'; this router serves 'tiny-text'"),
        (dict(token_ids=generation_pb2.TokenIds(ids=[49152])), grpc.StatusCode.INVALID_ARGUMENT,
         "outside the vocabulary"),
    ]
    for kwargs, code, message in cases:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generation_pb2.GenerateRequest(**kwargs)))
        assert info.value.code() == code and message in info.value.details(), (kwargs, info.value.details())
    tokens, _, _ = _collect(stub.Generate(generation_pb2.GenerateRequest(prompt="x", model="tiny-text", **_greedy(3))))
    assert len(tokens) == 3
    assert [m.id for m in stub.ListModels(generation_pb2.ListModelsRequest()).models] == ["tiny-text"]
    assert_no_leaks(workers)


def test_one_bad_request_on_a_stream_does_not_disturb_the_others(router):
    good = generation_pb2.GenerateRequest(request_id="good", prompt=PROMPTS[0], **_greedy())
    requests = [good, generation_pb2.GenerateRequest(request_id="bad", prompt="x", **_greedy(0)),
                generation_pb2.GenerateRequest(request_id="good", prompt="x", **_greedy()),  # duplicate id
                generation_pb2.GenerateRequest(prompt="x")]  # no id
    responses = asyncio.run(_stream_with_cancels(router.address, requests, set(), set()))
    errors = {(r.request_id, r.finished.error.code, r.finished.error.message) for rs in responses.values()
              for r in rs if r.HasField("finished") and r.finished.reason == common_pb2.FINISH_REASON_ERROR}
    assert ("bad", 3, "max_tokens must be >= 1, got 0 (0 only scores a prompt, with prompt_logprobs)") in errors
    assert ("good", 3, "request_id 'good' is already in flight on this stream; ids must be unique") in errors
    assert ("", 3, "request_id is required on GenerateStream") in errors
    tokens, _, _ = _collect(responses["good"])
    assert len(tokens) == MAX_TOKENS
    assert [r.finished.reason for r in responses["good"] if r.HasField("finished")].count(
        common_pb2.FINISH_REASON_LENGTH) == 1


def test_requests_beyond_the_inflight_limit_are_resource_exhausted(aggregated_router, workers):
    async def main() -> list:
        async with grpc.aio.insecure_channel(aggregated_router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            long = generation_pb2.GenerateRequest(prompt="x", **_greedy(200, ignore_eos=True))
            calls = [stub.Generate(long) for _ in range(4)]
            for call in calls:
                await call.read()  # in flight: it has sent a token
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(generation_pb2.GenerateRequest(prompt="x")).read()
            for call in calls:
                call.cancel()
            return info.value

    error = asyncio.run(main())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-inflight-requests=4" in error.details()
    assert_no_leaks(workers)


def test_fingerprint_mismatch_reaches_the_client_naming_both_sides(text_model, workers, decode_bf16):
    decode_bf16.wait_ready()
    router = _router(text_model, workers[:1], [decode_bf16])
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(_stub(router).Generate(generation_pb2.GenerateRequest(prompt=PROMPTS[0], **_greedy())))
        assert "fingerprint" in router.log() and "not interchangeable" in router.log()
    finally:
        stop_cleanly([router])
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "exporter='float32' importer='bfloat16'" in info.value.details()
    assert_no_leaks([workers[0], decode_bf16])


def test_sigterm_drains_in_flight_requests_then_exits(text_model, workers):
    router = _router(text_model, workers[:1], workers[1:])
    try:
        call = _stub(router).Generate(generation_pb2.GenerateRequest(prompt=PROMPTS[0], **_greedy(60, ignore_eos=True)))
        first = next(call)
        router.signal(signal.SIGTERM)
        tokens, _, finished = _collect([first, *call])
        assert len(tokens) == 60 and finished.reason == common_pb2.FINISH_REASON_LENGTH
    finally:
        assert router.stop() == 0, router.log()
    assert_no_leaks(workers)


def test_the_rpc_deadline_reaches_the_workers_and_frees_their_blocks(router, workers):
    stub = _stub(router)
    request = generation_pb2.GenerateRequest(prompt=PROMPTS[1], **_to_the_context())
    tokens = 0
    with pytest.raises(grpc.RpcError) as info:
        for response in stub.Generate(request, timeout=0.4):
            tokens += len(response.delta.token_ids)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and tokens > 0
    assert_no_leaks(workers)


def test_timeout_ms_ends_one_request_on_a_stream_and_the_others_finish(router, workers):
    slow = generation_pb2.GenerateRequest(request_id="slow", prompt=PROMPTS[1], timeout_ms=300,
                                          **_to_the_context())
    quick = generation_pb2.GenerateRequest(request_id="quick", prompt=PROMPTS[0], **_greedy())
    responses = asyncio.run(_stream_with_cancels(router.address, [slow, quick], set(), set()))
    tokens, _, finished = _collect(responses["slow"])
    assert finished.reason == common_pb2.FINISH_REASON_ERROR
    assert finished.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert f"passed its deadline of 300 ms after {len(tokens)} tokens were delivered" in finished.error.message
    assert 0 < len(tokens) == finished.usage.completion_tokens
    assert _collect(responses["quick"])[2].reason == common_pb2.FINISH_REASON_LENGTH
    assert_no_leaks(workers)


def test_routers_started_with_reuse_port_share_both_ports_and_split_new_connections(text_model, workers):
    """`disagg up`'s replicas (--reuse-port): two routers bind the same gRPC and HTTP ports, and requests on new
    connections are served by both, each counted once, with the workers' blocks all freed after. The first times its
    CPU a relayed token at warm-up (--time-relay, what up sizes the routers by) and says it in its serving line."""
    import urllib.request

    from benchmarks.processes import free_port
    from benchmarks.scrape import scrape

    port, http_port = free_port(), free_port()
    flags = ("--reuse-port", "--port", str(port), "--http-port", str(http_port), "--metrics-port", "0")
    routers = [_router(text_model, workers[:1], workers[1:], *flags, *extra) for extra in (("--time-relay",), ())]
    try:
        lines = [[line for line in r.log().splitlines() if "serving on" in line] for r in routers]
        assert re.search(r"\(warm-up [\d.]+ s, \d+ us of CPU a relayed token\)$", lines[0][0]), lines[0]
        assert re.search(r"\(warm-up [\d.]+ s\)$", lines[1][0]), lines[1]
        assert [r.address.rsplit(":", 1)[1] for r in routers] == [str(port)] * 2
        body = json.dumps({"prompt": "The sea", "max_tokens": 2, "temperature": 0}).encode()
        for _ in range(16):  # urllib: a new connection a request
            request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                assert json.loads(response.read())["choices"][0]["text"]
        served = [sum(v for k, v in scrape(r).items() if k.startswith("disagg_requests_total{")) for r in routers]
        assert sum(served) == 16 and min(served) > 0, served
        assert_no_leaks(workers)
    finally:
        stop_cleanly(routers)

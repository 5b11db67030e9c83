"""The OpenAI-compatible HTTP front door of a `disagg up` cluster, through clients none of us wrote: the `openai`
Python SDK and curl. Greedy text equals the native disagg.v1 path and Hugging Face, prefill→decode and aggregated;
a client that walks away mid-stream frees every block on every worker; bad input gets the right status and a clear
message, and the next request is still served."""
from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass

import aiohttp
import grpc
import openai
import pytest

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from common.tokenizer import Tokenizer
from services.serving import DEFAULT_MAX_MESSAGE_BYTES
from tests.hf_reference import hf_greedy
from tests.integration.leaks import assert_no_leaks
from tests.integration.test_router import make_text_model
from tests.integration.test_up import Up

MODES = {"prefill-decode": (), "aggregated": ("--prefill", "0")}
ENGINE = ("--block-size", "8", "--num-kv-blocks", "128")
PROMPT = "The sea is"
MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is the sea?"}]
MAX_TOKENS = 10


@dataclass(frozen=True)
class Worker:
    """A worker of the cluster, as tests/integration/leaks.py reads it."""

    name: str
    address: str

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)


@dataclass
class Cluster:
    up: Up
    router: str  # the gRPC address
    http: str  # http://host:port
    workers: list[Worker]
    metrics: str  # the router's Prometheus URL
    model: str = ""

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.http}/v1", api_key="unused", max_retries=0, timeout=60)

    def log(self) -> str:
        return "".join(self.up.lines)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(up: Up, needle: str, timeout_s: float = 10) -> str:
    deadline = time.monotonic() + timeout_s
    while needle not in "".join(up.lines):
        assert time.monotonic() < deadline, f"no {needle!r} in:\n" + "".join(up.lines)
        time.sleep(0.05)
    return "".join(up.lines)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> str:
    return str(make_text_model(tmp_path_factory.mktemp("models") / "tiny-text"))


@pytest.fixture(scope="module")
def tokenizer(text_model) -> Tokenizer:
    return Tokenizer.from_model_dir(text_model)


@pytest.fixture(scope="module", params=list(MODES))
def cluster(request, text_model):
    """One `disagg up` per mode, shared by the module's tests (pytest runs one mode's tests, then the other's)."""
    http_port = _free_port()  # `disagg up --http-port 0` turns HTTP off, so a free port is chosen here
    up = Up("--model", text_model, "--router-port", "0", "--http-port", str(http_port), *ENGINE,
            *MODES[request.param])
    try:
        router = up.wait()
        lines = _wait_for(up, "A process that dies is restarted")  # the banner's last line: it is all there
        workers = [Worker(*m) for m in re.findall(r"^\s+((?:prefill|decode)-\d+)\s+(\S+)", lines, re.M)]
        names = ["decode-0"] if MODES[request.param] else ["prefill-0", "decode-0"]
        assert [w.name for w in workers] == names, lines
        metrics = re.search(r"disagg-router metrics on (\S+)", lines).group(1)
        assert f"OpenAI-compatible HTTP on http://127.0.0.1:{http_port}/v1" in lines, lines
        cluster = Cluster(up, router, f"http://127.0.0.1:{http_port}", workers, metrics)
        cluster.model = cluster.sdk().models.list().data[0].id
        yield cluster
    finally:
        assert up.stop() == 0, "".join(up.lines)


def _native(cluster: Cluster, **request) -> str:
    """The text of a greedy disagg.v1 Generate."""
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with grpc.insecure_channel(cluster.router) as channel:
        responses = generation_pb2_grpc.GenerationStub(channel).Generate(
            generation_pb2.GenerateRequest(sampling=sampling, **request), timeout=60)
        return "".join(r.delta.text for r in responses if r.HasField("delta"))


def _hf(text_model: str, tokenizer: Tokenizer, prompt_ids: list[int]) -> tuple[str, list[int], list[float]]:
    ids, logprobs = hf_greedy(text_model, prompt_ids, MAX_TOKENS, stop_at_eos=True)
    return tokenizer.decode(ids), ids, logprobs


def test_sdk_completions_greedy_equal_native_grpc_and_hf_with_usage_and_logprobs(cluster, text_model, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    expected, ids, logprobs = _hf(text_model, tokenizer, prompt_ids)
    sdk = cluster.sdk()
    whole = sdk.completions.create(model=cluster.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                   logprobs=1)
    assert whole.choices[0].text == expected == _native(cluster, prompt=PROMPT)
    assert whole.choices[0].finish_reason == ("length" if len(ids) == MAX_TOKENS else "stop")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt_ids), len(ids))
    assert whole.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-3)
    stream = sdk.completions.create(model=cluster.model, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0,
                                    stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected  # token ids in, the same text out
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(prompt_ids) + len(ids)


def test_sdk_chat_greedy_equals_native_grpc_and_hf_streamed_and_whole(cluster, text_model, tokenizer):
    expected, ids, _ = _hf(text_model, tokenizer, tokenizer.apply_chat_template(MESSAGES))
    native = _native(cluster, chat=generation_pb2.Chat(messages=[generation_pb2.ChatMessage(**m) for m in MESSAGES]))
    sdk = cluster.sdk()
    whole = sdk.chat.completions.create(model=cluster.model, messages=MESSAGES, max_completion_tokens=MAX_TOKENS,
                                        temperature=0)
    assert whole.choices[0].message.content == expected == native and whole.choices[0].message.role == "assistant"
    assert whole.id.startswith("chatcmpl-") and whole.usage.completion_tokens == len(ids)
    chunks = list(sdk.chat.completions.create(model=cluster.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                              temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def _cancelled(cluster: Cluster) -> float:
    text = urllib.request.urlopen(cluster.metrics, timeout=10).read().decode()
    found = re.search(r'^disagg_requests_total\{[^}]*status="CANCELLED"[^}]*\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def _walk_away(url: str, body: dict) -> bytes:
    async with aiohttp.ClientSession() as session:
        response = await session.post(url, json=body)
        assert response.status == 200, await response.text()
        first = await response.content.readuntil(b"\n\n")
        response.close()  # the connection drops mid-stream
        return first


def test_a_client_that_walks_away_mid_stream_cancels_and_frees_every_block(cluster):
    before = _cancelled(cluster)
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}  # ~0.6 s of tokens
    first = asyncio.run(_walk_away(f"{cluster.http}/v1/completions", body))
    assert first.startswith(b"data: {"), first
    deadline = time.monotonic() + 10
    while _cancelled(cluster) < before + 1:  # the router counted it cancelled, not finished
        assert time.monotonic() < deadline, cluster.log()
        time.sleep(0.05)
    assert_no_leaks(cluster.workers)


def _post(cluster: Cluster, path: str, body: dict | bytes, method: str = "POST") -> tuple[int, dict]:
    host, port = cluster.http.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
# (name, path, body, status, words of the message). The core checks the ones that need the model or tokenizer.
BAD = [
    ("not-json", COMPLETIONS, b'{"prompt": ', 400, "not valid JSON"),
    ("not-an-object", COMPLETIONS, b'["The sea"]', 400, "must be a JSON object"),
    ("unknown-model", COMPLETIONS, {"model": "gpt-5", "prompt": PROMPT}, 404, "'gpt-5' does not exist"),
    ("empty-prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt is empty"),
    ("id-outside-vocab", COMPLETIONS, {"prompt": [5, 10**6]}, 400, "1000000"),
    ("prompt-over-context", COMPLETIONS, {"prompt": [5] * 300}, 400, "context"),
    ("max-tokens-over-context", COMPLETIONS, {"prompt": PROMPT, "max_tokens": 5000}, 400, "ask for at most"),
    ("negative-temperature", COMPLETIONS, {"prompt": PROMPT, "temperature": -1}, 400, "temperature must be >= 0"),
    ("two-choices", CHAT, {"messages": USER, "n": 2}, 400, "'n' must be 1"),
    ("tools", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "'tools' cannot be honoured"),
    ("no-messages", CHAT, {"max_tokens": 5}, 400, "'messages' is required"),
    ("image-for-text-model", CHAT, {"messages": [{"role": "user", "content": [IMAGE]}]}, 400, "takes no images"),
    ("several-prompts", COMPLETIONS, {"prompt": ["a", "b"]}, 400, "holds 2 prompts"),
    ("usage-without-stream", CHAT, {"messages": USER, "stream_options": {"include_usage": True}}, 400,
     "only allowed with"),
    ("too-many-logprobs", COMPLETIONS, {"prompt": PROMPT, "logprobs": 21}, 400, "must be in [0, 20]"),
    ("empty-stop", CHAT, {"messages": USER, "stop": [""]}, 400, "stop strings must not be empty"),
    ("deadline", COMPLETIONS, {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "timeout_ms": 1}, 504,
     "deadline"),
    ("body-too-large", COMPLETIONS, b'{"prompt": "' + b"x" * DEFAULT_MAX_MESSAGE_BYTES + b'"}', 413,
     "Maximum request body size"),
    ("unknown-route", "/v1/embeddings", {"input": "x"}, 404, "/v1/embeddings"),
    ("wrong-method", COMPLETIONS, b"", 405, "GET /v1/completions"),
]


@pytest.mark.parametrize("cluster", ["prefill-decode"], indirect=True)
def test_bad_input_gets_its_status_and_a_clear_message_then_the_next_request_is_served(cluster, text_model,
                                                                                       tokenizer):
    for name, path, body, status, words in BAD:
        got, response = _post(cluster, path, body, method="GET" if name == "wrong-method" else "POST")
        error = response["error"]
        assert (got, words in error["message"]) == (status, True), (name, response)
        assert set(error) == {"message", "type", "param", "code"}, (name, response)
    sdk = cluster.sdk()
    with pytest.raises(openai.BadRequestError, match="ask for at most"):
        sdk.completions.create(model=cluster.model, prompt=PROMPT, max_tokens=5000)
    with pytest.raises(openai.NotFoundError, match="'gpt-5' does not exist") as unknown:
        sdk.chat.completions.create(model="gpt-5", messages=USER)
    assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
    assert_no_leaks(cluster.workers)
    expected = _hf(text_model, tokenizer, tokenizer.encode(PROMPT))[0]
    assert sdk.completions.create(model=cluster.model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0).choices[0].text == expected


@pytest.mark.parametrize("cluster", ["prefill-decode"], indirect=True)
def test_curl_streams_raw_server_sent_events_ending_in_done(cluster, text_model, tokenizer):
    body = json.dumps({"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    result = subprocess.run(["curl", "-sS", "-N", "-D", "-", f"{cluster.http}/v1/chat/completions",
                             "-H", "Content-Type: application/json", "-d", body],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    head, _, stream = result.stdout.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 200") and "content-type: text/event-stream" in head.lower(), head
    events = stream.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2]), stream
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    expected, ids, _ = _hf(text_model, tokenizer, tokenizer.apply_chat_template(MESSAGES))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == expected
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ids)

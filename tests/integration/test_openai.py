"""The OpenAI-compatible HTTP front door of a `disagg up` front_doors, through clients none of us wrote: the `openai`
Python SDK and curl. Greedy text equals the native disagg.v1 path and Hugging Face, prefill→decode and aggregated;
a client that walks away mid-stream frees every block on every worker; bad input gets the right status and a clear
message, and the next request is still served."""
from __future__ import annotations

import asyncio
import http.client
import json
import re
import subprocess
import time
import urllib.request

import aiohttp
import openai
import pytest

from common.pb.disagg.v1 import generation_pb2
from common.tokenizer import Tokenizer
from services.kit.serving import DEFAULT_MAX_MESSAGE_BYTES
from tests.hf_reference import hf_greedy
from tests.integration.front_doors import CONTEXT, Cluster
from tests.integration.leaks import assert_no_leaks

PROMPT = "The sea is"
MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is the sea?"}]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def text_model(front_door_model) -> str:
    return front_door_model


@pytest.fixture(scope="module")
def tokenizer(text_model) -> Tokenizer:
    return Tokenizer.from_model_dir(text_model)


def _native(front_doors: Cluster, **request) -> str:
    return front_doors.native_text(MAX_TOKENS, **request)


def _hf(text_model: str, tokenizer: Tokenizer, prompt_ids: list[int]) -> tuple[str, list[int], list[float]]:
    ids, logprobs = hf_greedy(text_model, prompt_ids, MAX_TOKENS, stop_at_eos=True)
    return tokenizer.decode(ids), ids, logprobs


def test_sdk_completions_greedy_equal_native_grpc_and_hf_with_usage_and_logprobs(front_doors, text_model, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    expected, ids, logprobs = _hf(text_model, tokenizer, prompt_ids)
    sdk = front_doors.sdk()
    whole = sdk.completions.create(model=front_doors.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                   logprobs=1)
    assert whole.choices[0].text == expected == _native(front_doors, prompt=PROMPT)
    assert whole.choices[0].finish_reason == ("length" if len(ids) == MAX_TOKENS else "stop")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt_ids), len(ids))
    assert whole.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-3)
    stream = sdk.completions.create(model=front_doors.model, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0,
                                    stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected  # token ids in, the same text out
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(prompt_ids) + len(ids)


def test_sdk_chat_greedy_equals_native_grpc_and_hf_streamed_and_whole(front_doors, text_model, tokenizer):
    expected, ids, _ = _hf(text_model, tokenizer, tokenizer.apply_chat_template(MESSAGES))
    native = _native(front_doors, chat=generation_pb2.Chat(messages=[generation_pb2.ChatMessage(**m) for m in MESSAGES]))
    sdk = front_doors.sdk()
    whole = sdk.chat.completions.create(model=front_doors.model, messages=MESSAGES, max_completion_tokens=MAX_TOKENS,
                                        temperature=0)
    assert whole.choices[0].message.content == expected == native and whole.choices[0].message.role == "assistant"
    assert whole.id.startswith("chatcmpl-") and whole.usage.completion_tokens == len(ids)
    chunks = list(sdk.chat.completions.create(model=front_doors.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                              temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def _cancelled(front_doors: Cluster) -> float:
    text = urllib.request.urlopen(front_doors.metrics, timeout=10).read().decode()
    found = re.search(r'^disagg_requests_total\{[^}]*status="CANCELLED"[^}]*\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def _walk_away(url: str, body: dict) -> bytes:
    async with aiohttp.ClientSession() as session:
        response = await session.post(url, json=body)
        assert response.status == 200, await response.text()
        first = await response.content.readuntil(b"\n\n")
        response.close()  # the connection drops mid-stream
        return first


def test_a_client_that_walks_away_mid_stream_cancels_and_frees_every_block(front_doors):
    before = _cancelled(front_doors)
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}  # ~0.6 s of tokens
    first = asyncio.run(_walk_away(f"{front_doors.http}/v1/completions", body))
    assert first.startswith(b"data: {"), first
    deadline = time.monotonic() + 10
    while _cancelled(front_doors) < before + 1:  # the router counted it cancelled, not finished
        assert time.monotonic() < deadline, front_doors.log()
        time.sleep(0.05)
    assert_no_leaks(front_doors.workers)


def _post(front_doors: Cluster, path: str, body: dict | bytes, method: str = "POST") -> tuple[int, dict]:
    host, port = front_doors.http.removeprefix("http://").split(":")
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
    ("prompt-over-context", COMPLETIONS, {"prompt": [5] * CONTEXT}, 400, "context"),
    ("max-tokens-over-context", COMPLETIONS, {"prompt": PROMPT, "max_tokens": CONTEXT}, 400, "ask for at most"),
    ("negative-temperature", COMPLETIONS, {"prompt": PROMPT, "temperature": -1}, 400, "temperature must be >= 0"),
    ("too-many-choices", CHAT, {"messages": USER, "n": 17}, 400, "n must be in [1, 16]"),
    ("oversized-logit-bias", CHAT, {"messages": USER, "logit_bias": {str(i): 1 for i in range(301)}}, 400,
     "at most 300"),
    ("unknown-tool-choice", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                                   "tool_choice": {"type": "function", "function": {"name": "launch"}}}, 400,
     "'launch', which is not among the tools"),
    ("no-messages", CHAT, {"max_tokens": 5}, 400, "'messages' is required"),
    ("image-for-text-model", CHAT, {"messages": [{"role": "user", "content": [IMAGE]}]}, 400, "takes no images"),
    ("several-prompts", COMPLETIONS, {"prompt": ["a", "b"]}, 400, "holds 2 prompts"),
    ("usage-without-stream", CHAT, {"messages": USER, "stream_options": {"include_usage": True}}, 400,
     "only allowed with"),
    ("too-many-logprobs", COMPLETIONS, {"prompt": PROMPT, "logprobs": 21}, 400, "must be in [0, 20]"),
    ("empty-stop", CHAT, {"messages": USER, "stop": [""]}, 400, "stop strings must not be empty"),
    ("too-many-stops", CHAT, {"messages": USER, "stop": ["x"] * 65}, 400,
     "stop has 65 strings; at most 64 are accepted"),
    ("deadline", COMPLETIONS, {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "timeout_ms": 1}, 504,
     "deadline"),
    ("body-too-large", COMPLETIONS, b'{"prompt": "' + b"x" * DEFAULT_MAX_MESSAGE_BYTES + b'"}', 413,
     "Maximum request body size"),
    ("unknown-route", "/v1/embeddings", {"input": "x"}, 404, "/v1/embeddings"),
    ("wrong-method", COMPLETIONS, b"", 405, "GET /v1/completions"),
]


@pytest.mark.parametrize("front_doors", ["prefill-decode"], indirect=True)
def test_bad_input_gets_its_status_and_a_clear_message_then_the_next_request_is_served(front_doors, text_model,
                                                                                       tokenizer):
    for name, path, body, status, words in BAD:
        got, response = _post(front_doors, path, body, method="GET" if name == "wrong-method" else "POST")
        error = response["error"]
        assert (got, words in error["message"]) == (status, True), (name, response)
        assert set(error) == {"message", "type", "param", "code"}, (name, response)
    sdk = front_doors.sdk()
    with pytest.raises(openai.BadRequestError, match="ask for at most"):
        sdk.completions.create(model=front_doors.model, prompt=PROMPT, max_tokens=CONTEXT)
    with pytest.raises(openai.NotFoundError, match="'gpt-5' does not exist") as unknown:
        sdk.chat.completions.create(model="gpt-5", messages=USER)
    assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
    assert_no_leaks(front_doors.workers)
    expected = _hf(text_model, tokenizer, tokenizer.encode(PROMPT))[0]
    assert sdk.completions.create(model=front_doors.model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0).choices[0].text == expected


@pytest.mark.parametrize("front_doors", ["prefill-decode"], indirect=True)
def test_curl_without_a_json_content_type_gets_415(front_doors):
    """`curl -d` alone sends its body as a form (application/x-www-form-urlencoded)."""
    body = json.dumps({"messages": MESSAGES, "max_tokens": MAX_TOKENS})
    result = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", f"{front_doors.http}/v1/chat/completions",
                             "-d", body], capture_output=True, text=True, timeout=60)
    answer, _, status = result.stdout.rpartition("\n")
    error = json.loads(answer)["error"]
    assert status == "415" and error["code"] == "unsupported_media_type", result.stdout
    assert "'application/x-www-form-urlencoded'" in error["message"] and "application/json" in error["message"]


@pytest.mark.parametrize("front_doors", ["prefill-decode"], indirect=True)
def test_curl_streams_raw_server_sent_events_ending_in_done(front_doors, text_model, tokenizer):
    body = json.dumps({"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    result = subprocess.run(["curl", "-sS", "-N", "-D", "-", f"{front_doors.http}/v1/chat/completions",
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

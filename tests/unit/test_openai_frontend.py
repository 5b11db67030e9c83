"""The OpenAI HTTP front door over a fake core: body parsing and validation, SSE framing, error JSON and statuses,
and that a client walking away closes the core's stream."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict

from common import errors
from services.router.frontends.openai import make_app, start_http
from services.router.frontends.openai_responses import INTERNAL_MESSAGE
from services.router.generation import Finished, FinishReason, TextDelta, TokenLogprob, TopLogprob, Usage
from tests.fake_core import HANG, FakeCore

USAGE = Usage(prompt_tokens=5, completion_tokens=2, cached_prompt_tokens=4)
TWO_WORDS = [TextDelta((7,), "Hello"), TextDelta((8,), " sea"), Finished(FinishReason.LENGTH, USAGE)]


def serve(core: FakeCore, scenario, max_body_bytes: int = 4096):
    async def main():
        async with TestClient(TestServer(make_app(core, max_body_bytes))) as client:
            return await scenario(client)
    return asyncio.run(main())


JSON_TYPE = {"Content-Type": "application/json"}


def post(core: FakeCore, path: str, body, headers=None, **kwargs) -> tuple[int, dict, CIMultiDict]:
    """Status, JSON body and headers of one POST (body: JSON-able, or bytes sent as they are), sent as JSON unless
    `headers` says otherwise."""
    async def scenario(client):
        data = body if isinstance(body, bytes) else json.dumps(body)
        async with client.post(path, data=data, headers={**JSON_TYPE, **(headers or {})}) as response:
            return response.status, await response.json(), response.headers.copy()  # case-insensitive
    return serve(core, scenario, **kwargs)


def sse(core: FakeCore, path: str, body) -> tuple[list, str]:
    """The events of one streamed POST (JSON, or the literal [DONE]) and the content type."""
    async def scenario(client):
        async with client.post(path, json=body) as response:
            assert response.status == 200, await response.text()
            return await response.text(), response.headers["Content-Type"]
    text, content_type = serve(core, scenario)
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and all(b.startswith("data: ") for b in blocks[:-1]), text
    payloads = [b[len("data: "):] for b in blocks[:-1]]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads], content_type


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}


def test_chat_returns_openai_shape_with_usage_and_passes_sampling_to_the_core():
    core = FakeCore(TWO_WORDS)
    status, body, headers = post(core, "/v1/chat/completions", {
        **CHAT, "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "temperature": 0, "max_tokens": 9, "max_completion_tokens": 3, "stop": "\n", "seed": 5, "top_k": -1,
        "ignore_eos": True, "stop_token_ids": [2], "timeout_ms": 900, "user": "extra fields are ignored"},
        headers={"X-Request-Id": "r-1"})
    assert status == 200 and headers["X-Request-Id"] == "r-1"
    assert body["id"] == "chatcmpl-r-1" and body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello sea"},
                                "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    (request,) = core.requests
    assert request.request_id == "r-1" and request.model == "tiny" and request.timeout_ms == 900
    assert [(m.role, m.content) for m in request.messages] == [("system", "Be brief."), ("user", "Hi")]
    p = request.params
    assert (p.temperature, p.max_tokens, p.stop, p.seed, p.top_k, p.ignore_eos, p.stop_token_ids) == (
        0.0, 3, ("\n",), 5, 0, True, (2,))


def test_chat_stream_is_sse_role_first_then_text_finish_usage_and_done():
    events, content_type = sse(FakeCore(TWO_WORDS), "/v1/chat/completions",
                               {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert content_type.startswith("text/event-stream")
    *chunks, usage, done = events
    assert done == "[DONE]" and usage["choices"] == [] and usage["usage"]["total_tokens"] == 7
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "Hello"}, {"content": " sea"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1 and chunks[0]["id"].startswith("chatcmpl-")


def test_completion_stream_without_include_usage_has_no_usage():
    events, _ = sse(FakeCore(TWO_WORDS), "/v1/completions", {"prompt": "The sea", "stream": True})
    assert [c["choices"][0]["text"] for c in events[:-1]] == ["Hello", " sea", ""]
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"
    assert all("usage" not in c and c["object"] == "text_completion" for c in events[:-1])


def test_a_completion_streams_an_event_a_token_even_while_its_text_is_held_back():
    # Token 9 ends a partial character (its text comes with token 10): it still gets an event, as vLLM's server
    # sends, so a client timing events sees one a token. A chat stream says nothing until it has text.
    held = [TextDelta((7,), "Hello"), TextDelta((9,), ""), TextDelta((10,), " é"),
            Finished(FinishReason.LENGTH, USAGE)]
    events, _ = sse(FakeCore(held), "/v1/completions", {"prompt": "The sea", "stream": True})
    assert [c["choices"][0]["text"] for c in events[:-1]] == ["Hello", "", " é", ""]
    events, _ = sse(FakeCore(held), "/v1/chat/completions", {**CHAT, "stream": True})
    assert [c["choices"][0]["delta"] for c in events[:-1]] == [
        {"role": "assistant", "content": ""}, {"content": "Hello"}, {"content": " é"}, {}]


@pytest.mark.parametrize("prompt, expected", [
    ("The sea", {"prompt": "The sea", "token_ids": None}),
    ([5, 6, 7], {"prompt": None, "token_ids": (5, 6, 7)}),
    (["The sea"], {"prompt": "The sea", "token_ids": None}),
    ([[5, 6]], {"prompt": None, "token_ids": (5, 6)}),
])
def test_completion_prompt_is_a_string_or_token_ids_with_openai_default_max_tokens(prompt, expected):
    core = FakeCore(TWO_WORDS)
    status, body, _ = post(core, "/v1/completions", {"prompt": prompt})
    assert status == 200 and body["object"] == "text_completion" and body["choices"][0]["text"] == "Hello sea"
    assert body["id"].startswith("cmpl-") and len(body["id"]) == len("cmpl-") + 32  # a generated request id
    (request,) = core.requests
    assert {"prompt": request.prompt, "token_ids": request.token_ids} == expected
    assert request.params.max_tokens == 16 and request.messages is None


def _with_logprobs(*texts: str) -> list:
    deltas = [TextDelta((i,), text, (TokenLogprob(i, -0.5, text, (TopLogprob(i, -0.5, text), TopLogprob(9, -2.0, "x"))),))
              for i, text in enumerate(texts)]
    return [*deltas, Finished(FinishReason.STOP, USAGE)]


def test_completion_logprobs_have_tokens_top_dicts_and_offsets_across_chunks():
    core = FakeCore(_with_logprobs("ab", "cde"))
    events, _ = sse(core, "/v1/completions", {"prompt": "p", "logprobs": 2, "stream": True})
    assert core.requests[0].params.logprobs and core.requests[0].params.top_logprobs == 2
    logprobs = [e["choices"][0]["logprobs"] for e in events[:2]]
    assert logprobs == [{"tokens": ["ab"], "token_logprobs": [-0.5], "top_logprobs": [{"ab": -0.5, "x": -2.0}],
                         "text_offset": [0]},
                        {"tokens": ["cde"], "token_logprobs": [-0.5], "top_logprobs": [{"cde": -0.5, "x": -2.0}],
                         "text_offset": [2]}]
    _, body, _ = post(FakeCore(_with_logprobs("ab", "cde")), "/v1/completions", {"prompt": "p", "logprobs": 0})
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 2] and body["choices"][0]["finish_reason"] == "stop"


def test_chat_logprobs_have_content_entries_with_bytes_and_top_logprobs():
    _, body, _ = post(FakeCore(_with_logprobs("é")), "/v1/chat/completions",
                      {**CHAT, "logprobs": True, "top_logprobs": 2})
    assert body["choices"][0]["logprobs"] == {"content": [{
        "token": "é", "logprob": -0.5, "bytes": [195, 169],
        "top_logprobs": [{"token": "é", "logprob": -0.5, "bytes": [195, 169]},
                         {"token": "x", "logprob": -2.0, "bytes": [120]}]}]}


def test_image_parts_become_the_models_image_token_and_image_inputs():
    core = FakeCore(TWO_WORDS, image_token="<image>")
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
               {"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": "https://example.com/cat.png", "detail": "low"}}]
    status, body, _ = post(core, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}]})
    assert status == 200, body
    (request,) = core.requests
    assert request.messages[0].content == "<image>\nWhat is this?\n<image>"
    assert [(i.data_url, i.path) for i in request.images] == [("data:image/png;base64,AAAA", None),
                                                             (None, "https://example.com/cat.png")]


def _user(content) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
CHAT_PATH, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# (path, body, param, words of the message): every one a 400 naming what is wrong.
BAD_INPUTS = [
    (CHAT_PATH, {}, "messages", "is required"),
    (CHAT_PATH, {"messages": []}, "messages", "at least one message"),
    (CHAT_PATH, {"messages": "hi"}, "messages", "must be an array, got a string"),
    (CHAT_PATH, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "must be one of"),
    (CHAT_PATH, {"messages": [{"role": "user"}]}, "messages[0].content", "string or an array"),
    (CHAT_PATH, _user([{"type": "audio"}]), "messages[0].content[0].type", "'text' or 'image_url'"),
    (CHAT_PATH, _user([IMAGE]), "messages[0].content[0].image_url", "takes no images"),
    (CHAT_PATH, {**CHAT, "temperature": "hot"}, "temperature", "must be a number, got a string"),
    (CHAT_PATH, {**CHAT, "temperature": -1}, "temperature", "temperature must be >= 0"),
    (CHAT_PATH, {**CHAT, "top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    (CHAT_PATH, {**CHAT, "max_tokens": 0}, "max_tokens", "must be >= 1"),
    (CHAT_PATH, {**CHAT, "max_completion_tokens": True}, "max_completion_tokens", "must be an integer"),
    (CHAT_PATH, {**CHAT, "n": 17}, "n", "n must be in [1, 16]"),
    (CHAT_PATH, {**CHAT, "stream": "yes"}, "stream", "must be a boolean"),
    (CHAT_PATH, {**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "only allowed with"),
    (CHAT_PATH, {**CHAT, "stop": ["a", 3]}, "stop", "array of strings"),
    (CHAT_PATH, {**CHAT, "stop": [""]}, "stop", "must not be empty"),
    (CHAT_PATH, {**CHAT, "seed": -1}, "seed", "seed must be in"),
    (CHAT_PATH, {**CHAT, "top_logprobs": 3}, "top_logprobs", "needs 'logprobs': true"),
    (CHAT_PATH, {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "must be in [0, 20]"),
    (CHAT_PATH, {**CHAT, "tools": [{"type": "function"}]}, "tools[0].function", "is required"),
    (CHAT_PATH, {**CHAT, "response_format": {"type": "xml"}}, "response_format", "text, json_object or json_schema"),
    (CHAT_PATH, {**CHAT, "logit_bias": {"50": 101}}, "logit_bias", "biases in [-100, 100]"),
    (CHAT_PATH, {**CHAT, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
    (CHAT_PATH, {**CHAT, "logit_bias": {"a": 1}}, "logit_bias", "keys are token ids"),
    (CHAT_PATH, {**CHAT, "presence_penalty": 2.5}, "presence_penalty", "must be in [-2, 2]"),
    (CHAT_PATH, {**CHAT, "frequency_penalty": -3}, "frequency_penalty", "must be in [-2, 2]"),
    (CHAT_PATH, {**CHAT, "echo": True}, "echo", "is a /v1/completions field"),
    (CHAT_PATH, {**CHAT, "stop_token_ids": [-1]}, "stop_token_ids", "non-negative integers"),
    (COMPLETIONS, {}, "prompt", "it is required"),
    (COMPLETIONS, {"prompt": []}, "prompt", "must not be empty"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt", "holds 2 prompts"),
    (COMPLETIONS, {"prompt": [1, "a"]}, "prompt", "must be a string, an array"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, "max_tokens", "must be >= 1, got 0"),
    (COMPLETIONS, {"prompt": "a", "best_of": 3}, "best_of", "must equal n"),
    (COMPLETIONS, {"prompt": "a", "suffix": "end"}, "suffix", "insertion"),
    (COMPLETIONS, {"prompt": "a", "logprobs": True}, "logprobs", "must be an integer, got a boolean"),
    (COMPLETIONS, {"prompt": "a", "logprobs": 21}, "logprobs", "must be in [0, 20]"),
    (COMPLETIONS, {"prompt": "a", "timeout_ms": -5}, "timeout_ms", "must be >= 0"),
    # Sizes whose cost grows with the request: each names its limit.
    (CHAT_PATH, {**CHAT, "stop": ["x"] * 65}, "stop", "stop has 65 strings; at most 64 are accepted"),
    (CHAT_PATH, {**CHAT, "stop": ["x" * 4000, "y" * 97]}, "stop",
     "stop has 4097 characters in all; at most 4096 are accepted"),
    (COMPLETIONS, {"prompt": "a", "stop_token_ids": [2] * 1025}, "stop_token_ids",
     "stop_token_ids has 1025 ids; at most 1024 are accepted"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": ""}] * 2049}, "messages",
     "messages has 2049 messages; at most 2048 are accepted"),
]


@pytest.mark.parametrize("path, body, param, words", BAD_INPUTS, ids=[f"{p[4:]}-{m}" for p, _, m, _ in BAD_INPUTS])
def test_bad_input_is_400_naming_the_field(path, body, param, words):
    core = FakeCore(TWO_WORDS)
    status, response, _ = post(core, path, body, max_body_bytes=1 << 20)
    assert status == 400, response
    error = response["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
    assert not core.requests  # refused before the core saw it


def test_image_url_must_be_a_data_or_http_url_and_only_in_user_messages():
    core = FakeCore(TWO_WORDS, image_token="<image>")
    file_image = {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}
    status, body, _ = post(core, CHAT_PATH, _user([file_image]))
    assert status == 400 and body["error"]["param"] == "messages[0].content[0].image_url.url"
    status, body, _ = post(core, CHAT_PATH, {"messages": [{"role": "system", "content": [IMAGE]}]})
    assert status == 400 and "only in user messages" in body["error"]["message"]


@pytest.mark.parametrize("raw, words", [(b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"),
                                        (b"\xff\xfe", "not valid JSON")])
def test_a_body_that_is_not_a_json_object_is_400(raw, words):
    status, body, _ = post(FakeCore(TWO_WORDS), COMPLETIONS, raw)
    assert status == 400 and words in body["error"]["message"]


def test_the_largest_stops_and_messages_the_limits_allow_are_passed_to_the_core():
    core = FakeCore(TWO_WORDS)
    stops = [f"{i:02d}" + "x" * 62 for i in range(64)]  # 64 strings, 4096 characters
    messages = [{"role": "user", "content": "Hi"}] * 2048
    status, body, _ = post(core, CHAT_PATH, {**CHAT, "messages": messages, "stop": stops,
                                             "stop_token_ids": list(range(1024))}, max_body_bytes=1 << 20)
    assert status == 200, body
    (request,) = core.requests
    assert request.params.stop == tuple(stops) and len(request.params.stop_token_ids) == 1024
    assert len(request.messages) == 2048


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_sent_as_json_is_415_before_it_is_read(content_type):
    """What `curl -d` sends without -H 'Content-Type: application/json' (a form), a bare text/plain, or none."""
    core = FakeCore(TWO_WORDS)

    async def scenario(client):
        headers = {"Content-Type": content_type} if content_type else {}
        async with client.post(COMPLETIONS, data=json.dumps({"prompt": "x"}).encode(), headers=headers,
                               skip_auto_headers=["Content-Type"]) as response:
            return response.status, await response.json()
    status, body = serve(core, scenario)
    assert status == 415 and body["error"]["code"] == "unsupported_media_type"
    message = body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error" and "Content-Type: application/json" in message
    assert (repr(content_type) if content_type else "has none") in message
    assert not core.requests


def test_json_with_a_charset_or_in_other_case_is_json():
    status, body, _ = post(FakeCore(TWO_WORDS), COMPLETIONS, {"prompt": "x"},
                           headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert status == 200 and body["choices"][0]["text"] == "Hello sea"


def test_unknown_model_is_404_model_not_found_and_missing_model_is_the_served_one():
    status, body, headers = post(FakeCore(TWO_WORDS), CHAT_PATH, {**CHAT, "model": "gpt-5"},
                                 headers={"X-Request-Id": "r-9"})
    assert status == 404 and headers["X-Request-Id"] == "r-9"  # errors name the request too
    assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert "'gpt-5' does not exist" in body["error"]["message"] and "'tiny'" in body["error"]["message"]
    status, body, _ = post(FakeCore(TWO_WORDS), COMPLETIONS, {"prompt": "x"})
    assert status == 200 and body["model"] == "tiny"


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize("error, status, code", [
    (errors.InvalidRequest("max_tokens 500 exceeds the 100 tokens left in the context"), 400, "invalid_request"),
    (errors.FailedPrecondition("images need an encode worker"), 400, "failed_precondition"),
    (errors.NotFound("session expired"), 404, "not_found"),
    (errors.ResourceExhausted("the router has 64 requests in flight"), 429, "rate_limit_exceeded"),
    (errors.Unavailable("no decode worker is available"), 503, "service_unavailable"),
    (errors.DeadlineExceeded("passed its deadline of 50 ms"), 504, "timeout"),
    (_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV cache full"), 429, "rate_limit_exceeded"),
])
def test_core_errors_map_to_http_status_with_their_message(error, status, code):
    for stream in (False, True):  # raised before the first event: a streamed request gets the status too
        got, body, _ = post(FakeCore([error]), COMPLETIONS, {"prompt": "x", "stream": stream})
        assert (got, body["error"]["code"]) == (status, code)
        assert body["error"]["message"] == (error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error))


def test_an_unexpected_failure_is_a_generic_json_500_without_internals(caplog):
    status, body, _ = post(FakeCore([RuntimeError("secret internals at 0xdead")]), COMPLETIONS, {"prompt": "x"})
    assert status == 500 and body["error"]["message"] == INTERNAL_MESSAGE and "0xdead" not in json.dumps(body)
    assert "secret internals" in caplog.text  # logged with its traceback for the operator


def test_a_finished_event_that_says_error_is_raised_as_its_error():
    script = [Finished(FinishReason.ERROR, Usage(), error=errors.ResourceExhausted("KV pool full"))]
    status, body, _ = post(FakeCore(script), CHAT_PATH, CHAT)
    assert status == 429 and body["error"]["message"] == "KV pool full"


def test_an_error_after_streaming_started_is_an_sse_error_event_then_done():
    script = [TextDelta((7,), "Hello"), errors.DeadlineExceeded("passed its deadline after 1 token")]
    events, _ = sse(FakeCore(script), CHAT_PATH, {**CHAT, "stream": True})
    assert events[-2] == {"error": {"message": "passed its deadline after 1 token", "type": "timeout_error",
                                    "param": None, "code": "timeout"}}
    assert events[-1] == "[DONE]" and events[1]["choices"][0]["delta"] == {"content": "Hello"}


def test_a_client_that_walks_away_mid_stream_closes_the_core_stream():
    core = FakeCore([TextDelta((7,), "Hello"), HANG])

    async def scenario(client):
        response = await client.post(COMPLETIONS, json={"prompt": "x", "stream": True})
        assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
        response.close()  # drop the connection mid-stream
        await core.wait_closed()
    serve(core, scenario)
    assert core.closed == 1


def test_models_health_and_unknown_routes():
    core = FakeCore(TWO_WORDS, ready=False)

    async def scenario(client):
        got = {}
        for method, path in [("GET", "/v1/models"), ("GET", "/v1/models/tiny"), ("GET", "/v1/models/other"),
                             ("GET", "/health"), ("GET", "/health/live"), ("GET", "/v2/nothing"),
                             ("GET", COMPLETIONS)]:
            async with client.request(method, path) as response:
                got[path if method == "GET" and path != COMPLETIONS else "GET completions"] = (
                    response.status, await response.json(), response.headers.get("Allow"))
        return got
    got = serve(core, scenario)
    assert got["/v1/models"][:2] == (200, {"object": "list", "data": [
        {"id": "tiny", "object": "model", "created": 0, "owned_by": "disagg", "max_model_len": 128}]})
    assert got["/v1/models/tiny"][1]["id"] == "tiny" and got["/v1/models/other"][0] == 404
    assert got["/health"][:2] == (503, {"status": "not ready"}) and got["/health/live"][:2] == (200, {"status": "live"})
    assert got["/v2/nothing"][0] == 404 and got["/v2/nothing"][1]["error"]["code"] == "not_found"
    status, body, allow = got["GET completions"]
    assert status == 405 and body["error"]["code"] == "method_not_allowed" and allow == "POST"
    core.is_ready = True
    assert serve(core, lambda client: _status(client, "/health")) == 200


async def _status(client, path: str) -> int:
    async with client.get(path) as response:
        return response.status


def test_no_ready_worker_is_503_on_models_and_generation():
    core = FakeCore(TWO_WORDS)
    core.available = False
    assert post(core, COMPLETIONS, {"prompt": "x"})[0] == 503
    assert serve(core, lambda client: _status(client, "/v1/models")) == 503


def test_a_body_over_the_limit_is_413_json():
    status, body, _ = post(FakeCore(TWO_WORDS), COMPLETIONS, {"prompt": "x" * 5000}, max_body_bytes=1024)
    assert status == 413 and body["error"]["code"] == "request_too_large" and "1024" in body["error"]["message"]


def test_start_http_binds_a_free_port_serves_and_stops():
    async def main():
        door = await start_http(FakeCore(TWO_WORDS), "127.0.0.1", 0, 1024)
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{door.port}{COMPLETIONS}", json={"prompt": "x"}) as r:
                    body = await r.json()
        finally:
            await door.stop()
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as session:
                await session.get(f"http://127.0.0.1:{door.port}/health/live")
        return door.port, body
    port, body = asyncio.run(main())
    assert port > 0 and body["choices"][0]["text"] == "Hello sea"


def test_a_request_refused_while_parsing_is_still_counted_by_the_core():
    core = FakeCore(TWO_WORDS)
    status, body, _ = post(core, "/v1/chat/completions", {"messages": [], "n": 2})
    assert status == 400 and not core.requests
    assert len(core.rejections) == 1 and isinstance(core.rejections[0], errors.InvalidRequest)


def test_the_warm_up_sends_its_calls_through_an_app_of_its_own(tiny_llama):
    """The router's warm-up (router/warm_up.py) runs the door's calls over loopback HTTP on the core it is given,
    each to the end; with HTTP off it sends none, and a call that fails says which."""
    from services.router.config import RouterConfig
    from services.router.frontends.openai import _WARM_UP_CALLS, warm_up

    core = FakeCore(TWO_WORDS)
    asyncio.run(warm_up(core, RouterConfig(model=str(tiny_llama), http_port=8000)))
    assert len(core.requests) == len(_WARM_UP_CALLS) == core.closed
    assert [bool(r.messages) for r in core.requests] == [False, True, True]  # a completion, then two chats
    assert all(r.params.max_tokens == 2 for r in core.requests)
    asyncio.run(warm_up(core, RouterConfig(model=str(tiny_llama), http_port=0)))
    assert len(core.requests) == len(_WARM_UP_CALLS)
    failing = FakeCore([errors.Unavailable("no decode worker")])
    with pytest.raises(RuntimeError, match="POST /v1/completions: HTTP 503"):
        asyncio.run(warm_up(failing, RouterConfig(model=str(tiny_llama), http_port=8000)))

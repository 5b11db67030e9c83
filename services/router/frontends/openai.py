"""The router's OpenAI-compatible HTTP front door: /v1/chat/completions, /v1/completions, /v1/models, /health,
and the router's Prometheus /metrics. HTTPS with the router's --tls-cert/--tls-key; --api-key guards it
(openai_access.py).

aiohttp, embedded (AppRunner + TCPSite) in the router's running event loop beside grpc.aio, with no signal
handling of its own. `handler_cancellation=True` cancels a handler whose client disconnected; the cancellation
closes the core's stream (contextlib.aclosing), which cancels the request and frees its KV on every worker.
Errors are OpenAI's error JSON; the status comes from services.kit.serving.status_of and one table (responses).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import ssl
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from common import tls
from common.errors import DisaggError
from common.telemetry import tracing
from common.telemetry.metrics import Metrics
from services.kit.auth import ApiKeys
from services.kit.ports import port_taken
from services.kit.serving import DEFAULT_MAX_MESSAGE_BYTES
from services.router.config import RouterConfig
from services.router.frontends import FrontDoor
from services.router.frontends.openai_access import metrics_handler, require_api_key
from services.router.frontends.openai_requests import (ApiRequest, check_model, decode_body, parse_chat,
                                                       parse_completion)
from services.router.frontends.openai_responses import Json, Shapes, error_json, error_of
from services.router.frontends.openai_tools import ChatParsing
from services.router.generation import Core, Event, Finished, FinishReason, ServedModel, TextDelta

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")  # set by the middleware, per task
_SHUTDOWN_S = 5.0  # stop(): how long in-flight responses may take to finish before their handlers are cancelled
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}  # a proxy (nginx) must not buffer the stream
_HTTP_ERRORS = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
                415: "unsupported_media_type"}
_KEPT_HEADERS = ("Allow", "WWW-Authenticate")  # of aiohttp's HTTP errors, onto the JSON answer


class HttpFrontDoor:
    """A started HTTP server; `port` is the bound one (0 asked for a free port)."""

    def __init__(self, runner: web.AppRunner, port: int, https: bool = False):
        self._runner = runner
        self.port = port
        self.scheme = "https" if https else "http"

    def banner(self, host: str) -> str:
        return f"OpenAI-compatible HTTP on {self.scheme}://{host}:{self.port}/v1"

    async def stop(self) -> None:
        await self._runner.cleanup()


async def start(core: Core, config: RouterConfig, metrics: Metrics | None) -> HttpFrontDoor | None:
    """The router's HTTP front door on --http-port (0: none), HTTPS when the router serves TLS. PortTaken naming
    the flag when the port is held."""
    if not config.http_port:
        return None
    settings = tls.current()
    try:
        return await start_http(core, config.host, config.http_port, DEFAULT_MAX_MESSAGE_BYTES,
                                api_keys=config.api_keys, metrics=metrics.registry if metrics is not None else None,
                                ssl_context=settings.server_ssl_context() if settings.serves_tls else None,
                                chat=_chat_parsing(config.model, config.tool_call_parser, config.reasoning_parser),
                                reuse_port=config.reuse_port)
    except OSError as exc:
        raise port_taken(config.host, config.http_port, "--http-port (0 turns HTTP off)", exc) from None


# What warm_up sends: a streamed completion with logprobs, a streamed chat and a whole one (vLLM's bench and the
# openai SDK's usual calls), a couple of tokens each.
_WARM_UP_CALLS = (
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "stream": True, "logprobs": 1,
                         "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
                              "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
                              "logprobs": True, "top_logprobs": 1, "ignore_eos": True}),
)


async def warm_up(core: Core, config: RouterConfig) -> None:
    """Before SERVING, where HTTP is on: the calls above over loopback HTTP, to an app of the door's own making on a
    free port, served by `core` (the warm-up's, which counts in no metric): aiohttp's server and client paths, the
    request parsing, the answer shapes and the SSE writer run once before a client's first request takes them."""
    if not config.http_port:
        return
    chat = _chat_parsing(config.model, config.tool_call_parser, config.reasoning_parser)
    door = await start_http(core, "127.0.0.1", 0, DEFAULT_MAX_MESSAGE_BYTES, chat=chat)
    try:
        async with aiohttp.ClientSession() as session:
            for path, body in _WARM_UP_CALLS:
                async with session.post(f"http://127.0.0.1:{door.port}{path}", json=body) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"POST {path}: HTTP {response.status}")
    finally:
        await door.stop()


@functools.lru_cache(maxsize=4)
def _chat_parsing(model: str, tool_call_parser: str | None, reasoning_parser: str | None) -> ChatParsing:
    """Read from the model's chat template once a process (the door and its warm-up both take it), said once."""
    chat = ChatParsing.for_model(model, tool_call_parser, reasoning_parser)
    log.info("chat answers: tool calls read by the %s parser (%s), reasoning by %s", chat.tool_call_parser,
             "the chat template renders tools" if chat.template_takes_tools else
             "the chat template has no tools: they are written into the messages", chat.reasoning_parser or "none")
    return chat


async def start_http(core: Core, host: str, port: int, max_body_bytes: int, *, api_keys: ApiKeys = ApiKeys(),
                     metrics: CollectorRegistry | None = None, ssl_context: ssl.SSLContext | None = None,
                     chat: ChatParsing = ChatParsing(), reuse_port: bool = False) -> HttpFrontDoor:
    runner = web.AppRunner(make_app(core, max_body_bytes, api_keys=api_keys, metrics=metrics, chat=chat),
                           handler_cancellation=True, shutdown_timeout=_SHUTDOWN_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_port=reuse_port or None).start()
    except BaseException:
        await runner.cleanup()
        raise
    return HttpFrontDoor(runner, runner.addresses[0][1], https=ssl_context is not None)


def make_app(core: Core, max_body_bytes: int, *, api_keys: ApiKeys = ApiKeys(),
             metrics: CollectorRegistry | None = None, chat: ChatParsing = ChatParsing()) -> web.Application:
    """The routes; bodies over `max_body_bytes` are refused with 413 (as JSON, by the middleware). With keys, every
    route but health and /metrics needs one (401 otherwise); /metrics serves `metrics` (None: 404)."""
    handlers = _Handlers(core, chat)
    tracing.instrument_http_server()  # before the Application is made: the instrumentor wraps the class
    middlewares = [_errors_as_json, *([require_api_key(api_keys)] if api_keys.required else [])]
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app.router.add_post("/v1/chat/completions", handlers.chat)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/v1/models/{model}", handlers.model)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/health/live", handlers.live)
    if metrics is not None:
        app.router.add_get("/metrics", metrics_handler(metrics))
    return app


@web.middleware
async def _errors_as_json(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
    """Every failure becomes OpenAI's error JSON: aiohttp's own (unknown route, wrong method, body too large),
    the parsing's and the core's (by their status), and anything unexpected (a logged, generic 500). It also
    names the request: the client's X-Request-Id, else a new one, sent back on every answer."""
    request_id = request.headers.get(REQUEST_ID_HEADER, "").strip() or uuid.uuid4().hex
    _request_id.set(request_id)
    headers = {REQUEST_ID_HEADER: request_id}
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers.update({name: exc.headers[name] for name in _KEPT_HEADERS if name in exc.headers})
        message = f"{exc.reason}: {request.method} {request.path}" if exc.status in (404, 405) else exc.text
        body = error_json(message, "invalid_request_error", _HTTP_ERRORS.get(exc.status, "http_error"))
        return web.json_response(body, status=exc.status, headers=headers)
    except Exception as exc:
        status, body = error_of(exc)
        if status == 500:
            log.error("%s %s failed (request %s)", request.method, request.path, request_id, exc_info=exc)
        return web.json_response(body, status=status, headers=headers)


class _Handlers:
    def __init__(self, core: Core, chat: ChatParsing):
        self._core = core
        self._parse_chat = functools.partial(parse_chat, chat=chat)  # tool calls and reasoning, by the flags

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, self._parse_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_json(self._core.served_model())]})

    async def model(self, request: web.Request) -> web.Response:
        served = self._core.served_model()
        check_model(request.match_info["model"], served)
        return web.json_response(self._model_json(served))

    async def health(self, request: web.Request) -> web.Response:
        ready = self._core.ready()
        return web.json_response({"status": "ready" if ready else "not ready"}, status=200 if ready else 503)

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "live"})

    @staticmethod
    def _model_json(served: ServedModel) -> Json:
        return {"id": served.name, "object": "model", "created": 0, "owned_by": "disagg",
                "max_model_len": served.max_model_len}

    async def _generate(self, request: web.Request, parse: Callable[..., ApiRequest]) -> web.StreamResponse:
        request_id = _request_id.get()
        _require_json(request)
        try:
            api = parse(decode_body(await request.read()), request_id, self._core.served_model())
        except DisaggError as exc:  # refused before the core saw it: still counted under its status
            self._core.rejected(exc)
            raise
        shapes = Shapes(api, request_id, int(time.time()))
        headers = {REQUEST_ID_HEADER: request_id}
        async with contextlib.aclosing(self._core.stream(api.generation)) as events:
            if api.stream:
                return await _stream(request, events, shapes, headers)
            deltas: list[TextDelta] = []
            async for event in events:
                if isinstance(event, TextDelta):
                    deltas.append(event)
                else:
                    return web.json_response(shapes.response(deltas, _succeeded(event)), headers=headers)
        raise RuntimeError(f"request {request_id}: the core's stream ended without a Finished event")


def _require_json(request: web.Request) -> None:
    """415 for a body not sent as JSON (curl -d sends a form, a bare client text/plain), before it is read: parsing
    it as JSON anyway would answer what the client did not say it sent."""
    if request.content_type != "application/json":  # the media type, lower-cased, without its charset
        sent = request.headers.get("Content-Type")
        got = f"this request's is {sent!r}" if sent else "this request has none"
        raise web.HTTPUnsupportedMediaType(text=f"the body must be JSON, sent with 'Content-Type: application/json'; "
                                                f"{got}")


def _succeeded(finished: Finished) -> Finished:
    """The core raises its errors; a Finished that still says it failed is raised the same way."""
    if finished.reason in (FinishReason.STOP, FinishReason.LENGTH):
        return finished
    raise finished.error or RuntimeError(f"the request ended {finished.reason.value}")


async def _stream(request: web.Request, events: AsyncIterator[Event], shapes: Shapes,
                  headers: dict[str, str]) -> web.StreamResponse:
    """Server-Sent Events. The response starts with the first event, so that what fails before it (validation,
    no worker, a full queue) still gets its HTTP status; a failure after it is an error event, then [DONE]."""
    first = await anext(events)
    response = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
    await response.prepare(request)
    try:
        await _send_events(response, first, events, shapes)
    except ConnectionResetError:
        log.debug("request %s: the client went away mid-stream", headers[REQUEST_ID_HEADER])
        return response  # the caller's aclosing cancels the request
    except Exception as exc:
        status, body = error_of(exc)
        if status == 500:
            log.error("request %s failed mid-stream", headers[REQUEST_ID_HEADER], exc_info=exc)
        await _send(response, body)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _send_events(response: web.StreamResponse, event: Event, events: AsyncIterator[Event],
                       shapes: Shapes) -> None:
    for chunk in shapes.opening():
        await _send(response, chunk)
    while True:
        if isinstance(event, TextDelta):
            chunk = shapes.delta(event)
            if chunk is not None:
                await _send(response, chunk)
        else:
            for chunk in shapes.finish(_succeeded(event)):
                await _send(response, chunk)
            return
        event = await anext(events)


async def _send(response: web.StreamResponse, chunk: Json) -> None:
    await response.write(b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")


FRONT_DOOR = FrontDoor(start=start, warm_up=warm_up)

"""GenerateStream: many requests on one stream, each in its own task; one request's end never ends another."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

import grpc

from common.errors import InvalidRequest
from common.pb.disagg.v1 import generation_pb2
from services.router.frontends.grpc_convert import request_from_proto, response_of
from services.router.frontends.stream_tasks import StreamTasks
from services.router.orchestrator import Orchestrator
from services.router.streaming import ResponseBuilder
from services.kit.serving import status_of

log = logging.getLogger(__name__)


class Multiplexer:
    """Reads starts and cancels, runs each request as a task, writes every response from one place."""

    def __init__(self, orchestrator: Orchestrator):
        self._orchestrator = orchestrator
        self._running: dict[str, tuple[asyncio.Task, ResponseBuilder]] = {}
        self._cancelled: set[str] = set()
        self._tasks = StreamTasks("GenerateStreamRequest")

    async def serve(self, requests: AsyncIterator[generation_pb2.GenerateStreamRequest],
                    context: grpc.aio.ServicerContext) -> None:
        """Until the client half-closed and every request finished. Raises InvalidRequest for a
        malformed stream message; leaving early (RPC cancelled) cancels every request."""
        await self._tasks.serve(requests, self._on_message, context.write)

    def _on_message(self, message: generation_pb2.GenerateStreamRequest) -> None:
        kind = message.WhichOneof("kind")
        if kind == "start":
            self._start(message.start)
        elif kind == "cancel":
            self._cancel(message.cancel.request_id)
        else:
            raise InvalidRequest("a GenerateStreamRequest must set start or cancel")

    def _start(self, request: generation_pb2.GenerateRequest) -> None:
        request_id = request.request_id
        out = self._orchestrator.response(request_id)
        if not request_id:
            self._send(out.failed(InvalidRequest("request_id is required on GenerateStream")), request_id)
        elif request_id in self._running:
            self._send(out.failed(InvalidRequest(
                f"request_id {request_id!r} is already in flight on this stream; ids must be unique")), request_id)
        else:
            task = self._tasks.start(self._run(request, out), lambda t: self._done(out, t))
            self._running[request_id] = (task, out)

    def _cancel(self, request_id: str) -> None:
        task, out = self._running.get(request_id, (None, None))
        if task is not None and not out.finished:
            self._cancelled.add(request_id)
            task.cancel()

    async def _run(self, request: generation_pb2.GenerateRequest, out: ResponseBuilder) -> None:
        try:
            core_request = request_from_proto(request, out.request_id)
            async with contextlib.aclosing(self._orchestrator.generate(core_request, out)) as events:
                async for event in events:
                    self._send(event, out.request_id)
        except Exception as exc:
            if status_of(exc) is grpc.StatusCode.INTERNAL:
                log.exception("request %s failed", out.request_id)
            self._send(out.failed(exc), out.request_id)

    def _send(self, event, request_id: str) -> None:
        self._tasks.send(response_of(request_id, event))

    def _done(self, out: ResponseBuilder, task: asyncio.Task) -> None:
        request_id = out.request_id
        if task.cancelled() and request_id in self._cancelled and not out.finished:
            self._send(out.cancelled(), request_id)
        self._running.pop(request_id, None)
        self._cancelled.discard(request_id)

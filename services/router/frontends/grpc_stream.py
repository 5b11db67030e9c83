"""GenerateStream: many requests on one stream, each in its own task; one request's end never ends another.

Each request is the core's event stream (Core.stream); a cancel message cancels the stream of that request id on
this stream (ids are unique per stream, not across clients), which then ends with Finished(CANCELLED)."""
from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator

import grpc

from common.errors import InvalidRequest
from common.pb.disagg.v1 import generation_pb2
from services.kit.serving import status_of
from services.router.frontends.grpc_convert import request_from_proto, response_of
from services.router.frontends.stream_tasks import StreamTasks
from services.router.generation import Core, Event, EventStream, Finished, FinishReason, Usage

log = logging.getLogger(__name__)


class Multiplexer:
    """Reads starts and cancels, runs each request as a task, writes every response from one place."""

    def __init__(self, core: Core):
        self._core = core
        self._running: dict[str, EventStream] = {}
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
            stream = self._running.get(message.cancel.request_id)
            if stream is not None:
                stream.cancel()
        else:
            raise InvalidRequest("a GenerateStreamRequest must set start or cancel")

    def _start(self, request: generation_pb2.GenerateRequest) -> None:
        request_id = request.request_id
        try:
            if not request_id:
                raise InvalidRequest("request_id is required on GenerateStream")
            if request_id in self._running:
                raise InvalidRequest(f"request_id {request_id!r} is already in flight on this stream; "
                                     "ids must be unique")
            stream = self._core.stream(request_from_proto(request, request_id))
        except Exception as exc:  # refused before the core saw it: counted under its status all the same
            _log_internal(request_id, exc)
            self._core.rejected(exc)
            self._send(request_id, Finished(reason=FinishReason.ERROR, usage=Usage(), error=exc))
            return
        self._running[request_id] = stream
        self._tasks.start(self._run(request_id, stream), lambda _: self._running.pop(request_id, None))

    async def _run(self, request_id: str, stream: EventStream) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for event in stream:
                    self._send(request_id, event)
        except Exception as exc:
            _log_internal(request_id, exc)
            self._send(request_id, stream.failed(exc))

    def _send(self, request_id: str, event: Event) -> None:
        self._tasks.send(response_of(request_id, event))


def _log_internal(request_id: str, exc: BaseException) -> None:
    if status_of(exc) is grpc.StatusCode.INTERNAL:
        log.exception("request %s failed", request_id, exc_info=exc)

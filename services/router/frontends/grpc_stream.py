"""GenerateStream: many requests on one stream, each in its own task; one request's end never ends another."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Union

import grpc
from google.protobuf.message import DecodeError

from common.errors import InvalidRequest
from common.pb.disagg.v1 import generation_pb2
from services.router.frontends.grpc_convert import request_from_proto, response_of
from services.router.orchestrator import Orchestrator
from services.router.streaming import ResponseBuilder
from services.kit.serving import status_of

log = logging.getLogger(__name__)

# A response to send, the error that ends the whole stream, or None: every request is done.
_Item = Union[generation_pb2.GenerateResponse, InvalidRequest, None]


class Multiplexer:
    """Reads starts and cancels, runs each request as a task, writes every response from one place."""

    def __init__(self, orchestrator: Orchestrator):
        self._orchestrator = orchestrator
        self._running: dict[str, tuple[asyncio.Task, ResponseBuilder]] = {}
        self._cancelled: set[str] = set()
        self._out: asyncio.Queue[_Item] = asyncio.Queue()
        self._reading = True

    async def serve(self, requests: AsyncIterator[generation_pb2.GenerateStreamRequest],
                    context: grpc.aio.ServicerContext) -> None:
        """Until the client half-closed and every request finished. Raises InvalidRequest for a
        malformed stream message; leaving early (RPC cancelled) cancels every request."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while (item := await self._out.get()) is not None:
                if isinstance(item, InvalidRequest):
                    raise item
                await context.write(item)
        finally:
            reader.cancel()
            tasks = [task for task, _ in self._running.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[generation_pb2.GenerateStreamRequest]) -> None:
        try:
            async for message in requests:
                kind = message.WhichOneof("kind")
                if kind == "start":
                    self._start(message.start)
                elif kind == "cancel":
                    self._cancel(message.cancel.request_id)
                else:
                    self._out.put_nowait(InvalidRequest("a GenerateStreamRequest must set start or cancel"))
                    return
        except DecodeError as exc:  # bytes that are no GenerateStreamRequest: end the stream, not silently
            self._out.put_nowait(InvalidRequest(f"could not parse a GenerateStreamRequest: {exc}"))
        finally:
            self._reading = False
            self._end_if_idle()

    def _start(self, request: generation_pb2.GenerateRequest) -> None:
        request_id = request.request_id
        out = self._orchestrator.response(request_id)
        if not request_id:
            self._send(out.failed(InvalidRequest("request_id is required on GenerateStream")), request_id)
        elif request_id in self._running:
            self._send(out.failed(InvalidRequest(
                f"request_id {request_id!r} is already in flight on this stream; ids must be unique")), request_id)
        else:
            task = asyncio.create_task(self._run(request, out))
            self._running[request_id] = (task, out)
            task.add_done_callback(lambda t: self._done(out, t))

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
        self._out.put_nowait(response_of(request_id, event))

    def _done(self, out: ResponseBuilder, task: asyncio.Task) -> None:
        """A done callback, not a `finally`: a task cancelled before it ever ran has none."""
        request_id = out.request_id
        if task.cancelled() and request_id in self._cancelled and not out.finished:
            self._send(out.cancelled(), request_id)
        self._running.pop(request_id, None)
        self._cancelled.discard(request_id)
        self._end_if_idle()

    def _end_if_idle(self) -> None:
        if not self._reading and not self._running:
            self._out.put_nowait(None)

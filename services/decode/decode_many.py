"""Decoder.DecodeMany: many requests on one stream, each one Decode's, tagged.

A router keeps one such stream to each decode worker. gRPC's cost is per message on both sides (a write's
completion through the poller, a read's callback), and a Decode stream sends one message per request per engine
step; here everything the requests made while the last write was under way goes out as one message. The requests
themselves run exactly as on Decode (DecodeServicer.begin): the same admission, refusals, session rules and cleanup.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import context as otel_context
from opentelemetry import propagate

from common.errors import InvalidRequest
from common.pb.disagg.v1 import worker_pb2
from services.decode.progress import join_delta
from services.kit.serving import abort_with, status_details
from services.worker.service import WorkerState

if TYPE_CHECKING:
    from services.decode.server import Running


Begin = Callable[[worker_pb2.DecodeStart, "float | None", Callable[[object], None]], Awaitable["Running"]]
_ENDED = object()  # a request's task is over: its `end` follows (OK unless an exception ended it)
_READ_ALL = object()  # the client half-closed: the stream ends once its requests have


@dataclass
class _Request:
    task: asyncio.Task  # admits the request and waits for its work
    running: Running | None = None  # once admitted
    cancelled: bool = False  # a cancel came before it was admitted


class DecodeManyStream:
    def __init__(self, state: WorkerState, begin: Begin):
        self._state = state
        self._begin = begin
        self._outbox: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._requests: dict[int, _Request] = {}
        self._errors: dict[int, tuple[grpc.StatusCode, str]] = {}  # what ends a request, sent when its task is over
        self._closing = False  # the client half-closed: the stream ends once its requests have
        self._malformed: InvalidRequest | None = None  # a message the stream cannot carry on after

    async def serve(self, request_iterator: AsyncIterator[worker_pb2.DecodeManyRequest],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.DecodeManyResponse]:
        reader = asyncio.create_task(self._read(request_iterator))
        try:
            while not (self._closing and not self._requests and self._outbox.empty()):
                entries = _Batch()
                self._book(entries, *await self._outbox.get())
                while not self._outbox.empty():  # what came while the last write was under way
                    self._book(entries, *self._outbox.get_nowait())
                if self._malformed is not None:
                    await abort_with(context, self._malformed)
                if entries.messages:
                    yield worker_pb2.DecodeManyResponse(messages=entries.messages)
        finally:  # the client went away or the stream failed: every request's cleanup frees its blocks
            reader.cancel()
            for request in self._requests.values():
                request.task.cancel()

    def _book(self, entries: _Batch, tag: int, what: object) -> None:
        """One outbox item into the next response: a message, a request's end, or the stream's own news."""
        if what is _READ_ALL:
            self._closing = True
        elif tag < 0:  # the stream itself is malformed
            self._malformed = what
        elif what is _ENDED:  # its `end` goes out now, so the tag is free when the client reads it
            self._requests.pop(tag, None)
            entries.end(tag, *self._errors.pop(tag, (grpc.StatusCode.OK, "")))
        elif isinstance(what, BaseException):
            self._errors.setdefault(tag, status_details(what))  # the first error ends the request
        else:
            entries.add(tag, what)

    async def _read(self, request_iterator: AsyncIterator[worker_pb2.DecodeManyRequest]) -> None:
        try:
            async for request in request_iterator:
                for tagged in request.messages:
                    self._take(tagged)
        except DecodeError as exc:
            self._outbox.put_nowait((-1, InvalidRequest(f"could not parse a DecodeManyRequest: {exc}")))
        except InvalidRequest as exc:
            self._outbox.put_nowait((-1, exc))
        else:
            self._outbox.put_nowait((-1, _READ_ALL))

    def _take(self, tagged: worker_pb2.TaggedDecodeClientMessage) -> None:
        tag, kind = tagged.tag, tagged.message.WhichOneof("kind")
        if kind == "start":
            if tag in self._requests:
                raise InvalidRequest(f"DecodeMany: tag {tag} already runs a request; a tag is reused only after "
                                     "its `end`")
            time_left_s = tagged.timeout_s if tagged.HasField("timeout_s") else None
            context = contextvars.copy_context()
            if tagged.trace_context:  # the request's spans hang under the caller's, not under this stream's
                context.run(otel_context.attach, propagate.extract(dict(tagged.trace_context)))
            task = asyncio.create_task(self._run(tag, tagged.message.start, time_left_s), context=context)
            self._requests[tag] = _Request(task)
            task.add_done_callback(lambda _, tag=tag: self._outbox.put_nowait((tag, _ENDED)))
        elif kind == "cancel":
            request = self._requests.get(tag)
            if request is None:
                return  # it ended already: a cancel crossing its end
            index = tagged.message.cancel.index if tagged.message.cancel.HasField("index") else None
            if request.running is not None:
                request.running.cancel(index)
            elif index is None:
                request.cancelled = True
        else:
            raise InvalidRequest(f"DecodeMany: tag {tag}'s message has neither `start` nor `cancel`")

    async def _run(self, tag: int, start: worker_pb2.DecodeStart, time_left_s: float | None) -> None:
        def put(item: object) -> None:
            self._outbox.put_nowait((tag, item))

        request = self._requests[tag]
        with self._state.admission.counted():  # the drain waits for each request, not for the stream
            try:
                running = await self._begin(start, time_left_s, put)
            except Exception as exc:
                put(exc)
                return
            request.running = running
            if request.cancelled:
                running.cancel()
            try:
                await asyncio.shield(running.work)
            except asyncio.CancelledError:  # the stream is going away: end the work and wait for its cleanup
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running.work
                raise


class _Batch:
    """One response's entries: consecutive deltas of one request's choice join (as a Decode stream's do)."""

    def __init__(self) -> None:
        self.messages: list[worker_pb2.TaggedDecodeServerMessage] = []
        self._last: dict[int, worker_pb2.TaggedDecodeServerMessage] = {}  # each tag's last entry in this batch

    def add(self, tag: int, message: worker_pb2.DecodeServerMessage) -> None:
        last = self._last.get(tag)
        if last is not None and last.HasField("message") and join_delta(last.message, message):
            return
        entry = worker_pb2.TaggedDecodeServerMessage(tag=tag, message=message)
        self.messages.append(entry)
        self._last[tag] = entry

    def end(self, tag: int, code: grpc.StatusCode, details: str) -> None:
        entry = worker_pb2.TaggedDecodeServerMessage(
            tag=tag, end=worker_pb2.RequestStatus(code=code.value[0], message=details))
        self.messages.append(entry)
        self._last[tag] = entry


"""ModelStreamInfer: Triton's decoupled streaming. Many requests on one stream, each in its own task.

A request with `stream` true gets one response per text delta, then one with `finish_reason`; otherwise one
response with the whole text. Every response carries `triton_final_response` (true on the request's last);
with `triton_enable_empty_final_response` the last is an extra response without outputs, as Triton sends it.
A request's error is its own response's `error_message` (with its id); the stream goes on. Closing the stream
cancels every request on it, which frees their KV on every worker.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Union

import grpc
from google.protobuf.message import DecodeError

from common.errors import DisaggError, InvalidRequest
from common.pb.inference import grpc_service_pb2 as pb
from services.router.frontends.kserve_model import TEXT_OUTPUT, Reply, check_model
from services.router.frontends.kserve_request import KserveRequest, parse_request
from services.router.generation import Core, Finished
from services.kit.serving import message_of, status_of

log = logging.getLogger(__name__)

# A response to write, the error that ends the whole stream, or None: the client half-closed, all done.
_Item = Union[pb.ModelStreamInferResponse, InvalidRequest, None]


def finish_reason(finished: Finished) -> str:
    if finished.error is not None:
        raise finished.error
    return finished.reason.value


def parse_for(core: Core, request: pb.ModelInferRequest, unary: bool = False) -> KserveRequest:
    """The request, once its model is the served one (NotFound otherwise; Unavailable with no worker). A refused
    request is counted by the core's metrics, as the requests it refuses itself are."""
    try:
        model = core.served_model()
        check_model(request.model_name, request.model_version, model)
        parsed = parse_request(request, model.name)
        if unary and parsed.stream:
            raise InvalidRequest("input 'stream' is true, but ModelInfer sends one response; "
                                 "stream with ModelStreamInfer (tritonclient: start_stream + async_stream_infer)")
    except DisaggError as exc:
        core.rejected(exc)
        raise
    return parsed


async def whole_text(core: Core, request: KserveRequest, timeout_s: float | None) -> tuple[str, str]:
    """(the generated text, its finish reason)."""
    parts: list[str] = []
    async with contextlib.aclosing(core.stream(request.generation, timeout_s)) as events:
        async for event in events:
            if isinstance(event, Finished):
                return "".join(parts), finish_reason(event)
            parts.append(event.text)
    raise RuntimeError(f"request {request.generation.request_id}: the core's events ended without a Finished")


def error_text(exc: BaseException) -> str:
    """As tritonclient prints a failed unary call, so a stream error reads the same: `[StatusCode.X] why`."""
    return f"[{status_of(exc)}] {message_of(exc) or type(exc).__name__}"


class StreamSession:
    """One ModelStreamInfer call: reads requests, runs each as a task, writes every response from one place."""

    def __init__(self, core: Core, context: grpc.aio.ServicerContext):
        self._core = core
        self._context = context
        self._tasks: set[asyncio.Task] = set()
        self._out: asyncio.Queue[_Item] = asyncio.Queue()
        self._reading = True

    async def serve(self, requests: AsyncIterator[pb.ModelInferRequest]) -> None:
        """Until the client half-closed and every request finished. Raises InvalidRequest for bytes that are
        no ModelInferRequest; leaving early (the call cancelled) cancels every request."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while (item := await self._out.get()) is not None:
                if isinstance(item, InvalidRequest):
                    raise item
                await self._context.write(item)
        finally:
            reader.cancel()
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[pb.ModelInferRequest]) -> None:
        try:
            async for request in requests:
                task = asyncio.create_task(self._run(request))
                self._tasks.add(task)
                task.add_done_callback(self._done)  # not a `finally`: a task cancelled before it ran has none
        except DecodeError as exc:
            self._out.put_nowait(InvalidRequest(f"could not parse a ModelInferRequest: {exc}"))
        finally:
            self._reading = False
            self._end_if_idle()

    async def _run(self, request: pb.ModelInferRequest) -> None:
        reply = Reply(request.model_name, request.id)
        try:
            parsed = parse_for(self._core, request)
            reply = parsed.reply
            if parsed.stream:
                await self._stream(parsed)
            else:
                text, reason = await whole_text(self._core, parsed, self._context.time_remaining())
                self._finish(parsed, reply.response(text, reason))
        except Exception as exc:
            if status_of(exc) is grpc.StatusCode.INTERNAL:
                log.exception("KServe request %r failed", request.id)
            self._out.put_nowait(reply.error(error_text(exc)))

    async def _stream(self, request: KserveRequest) -> None:
        reply = request.reply
        events = self._core.stream(request.generation, self._context.time_remaining())
        async with contextlib.aclosing(events) as events:
            async for event in events:
                if isinstance(event, Finished):
                    self._finish(request, reply.response("", finish_reason(event)))
                elif event.text and TEXT_OUTPUT in reply.outputs:  # text may lag a token: nothing to send yet
                    self._out.put_nowait(reply.stream_response(reply.response(event.text), final=False))

    def _finish(self, request: KserveRequest, response: pb.ModelInferResponse) -> None:
        self._out.put_nowait(request.reply.stream_response(response, final=not request.empty_final))
        if request.empty_final:
            self._out.put_nowait(request.reply.empty_final())

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._end_if_idle()

    def _end_if_idle(self) -> None:
        if not self._reading and not self._tasks:
            self._out.put_nowait(None)

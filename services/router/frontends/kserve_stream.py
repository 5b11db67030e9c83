"""ModelStreamInfer: Triton's decoupled streaming. Many requests on one stream, each in its own task.

A request with `stream` true gets one response per text delta, then one with `finish_reason`; otherwise one
response with the whole text. Every response carries `triton_final_response` (true on the request's last);
with `triton_enable_empty_final_response` the last is an extra response without outputs, as Triton sends it.
A request's error is its own response's `error_message` (with its id); the stream goes on. Closing the stream
cancels every request on it, which frees their KV on every worker.
"""
from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator

import grpc

from common.errors import DisaggError, InvalidRequest
from common.pb.inference import grpc_service_pb2 as pb
from services.router.frontends.kserve_model import TEXT_OUTPUT, Reply, check_model
from services.router.frontends.kserve_request import KserveRequest, parse_request
from services.router.frontends.stream_tasks import StreamTasks
from services.router.generation import Core, Finished
from services.kit.serving import message_of, status_of

log = logging.getLogger(__name__)


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
        self._tasks = StreamTasks("ModelInferRequest")

    async def serve(self, requests: AsyncIterator[pb.ModelInferRequest]) -> None:
        """Until the client half-closed and every request finished. Raises InvalidRequest for bytes that are
        no ModelInferRequest; leaving early (the call cancelled) cancels every request."""
        await self._tasks.serve(requests, lambda request: self._tasks.start(self._run(request)),
                                 self._context.write)

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
            self._tasks.send(reply.error(error_text(exc)))

    async def _stream(self, request: KserveRequest) -> None:
        reply = request.reply
        events = self._core.stream(request.generation, self._context.time_remaining())
        async with contextlib.aclosing(events) as events:
            async for event in events:
                if isinstance(event, Finished):
                    self._finish(request, reply.response("", finish_reason(event)))
                elif event.text and TEXT_OUTPUT in reply.outputs:  # text may lag a token: nothing to send yet
                    self._tasks.send(reply.stream_response(reply.response(event.text), final=False))

    def _finish(self, request: KserveRequest, response: pb.ModelInferResponse) -> None:
        self._tasks.send(request.reply.stream_response(response, final=not request.empty_final))
        if request.empty_final:
            self._tasks.send(request.reply.empty_final())

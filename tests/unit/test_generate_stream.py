"""GenerateStream through the core protocol only (generation.Core): each start is the core's event stream, a
cancel by request id ends that request alone with Finished(CANCELLED), and a start the door refuses (no id, an id
already in flight on the stream, a bad field) is an error Finished counted by the core."""
from __future__ import annotations

import asyncio

from common.pb.disagg.v1 import common_pb2, generation_pb2
from services.router.deadline import Deadline
from services.router.flight import Flight
from services.router.frontends.grpc_stream import Multiplexer
from services.router.generation import GenerationRequest, ServedModel, TextDelta
from services.router.responses import ResponseBuilder


class HangingCore:
    """A core whose requests each send one delta, then wait for a worker that never answers."""

    def __init__(self) -> None:
        self.rejected_ids: list[str] = []
        self.freed: list[str] = []

    def served_model(self) -> ServedModel:
        return ServedModel("m", 64)

    def ready(self) -> bool:
        return True

    def rejected(self, exc: BaseException) -> None:
        self.rejected_ids.append(str(exc))

    def stream(self, request: GenerationRequest, timeout_s: float | None = None) -> Flight:
        return Flight(request, ResponseBuilder(request.request_id, None), Deadline(None, 0), self._loop)

    async def _loop(self, flight: Flight):
        try:
            yield TextDelta(token_ids=(1,), text="a")
            await asyncio.sleep(3600)
        finally:
            self.freed.append(flight.request_id)


class Context:
    def __init__(self) -> None:
        self.written: list[generation_pb2.GenerateResponse] = []

    async def write(self, response: generation_pb2.GenerateResponse) -> None:
        self.written.append(response)


def _start(request_id: str, **fields) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(start=generation_pb2.GenerateRequest(
        request_id=request_id, prompt="hi", **fields))


def _cancel(request_id: str) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(cancel=common_pb2.Cancel(request_id=request_id))


def test_cancel_by_id_ends_only_that_request_and_refused_starts_get_an_error_finished():
    core, context = HangingCore(), Context()
    freed_after_first_cancel: list[str] = []

    async def client():
        for message in (_start("a"), _start("b"), _start(""), _start("a"),
                        _start("c", sampling=common_pb2.SamplingParams(temperature=-1.0))):
            yield message
        await asyncio.sleep(0.1)
        yield _cancel("a")
        await asyncio.sleep(0.1)
        freed_after_first_cancel.extend(core.freed)
        yield _cancel("b")

    asyncio.run(asyncio.wait_for(Multiplexer(core).serve(client(), context), 10))
    assert freed_after_first_cancel == ["a"]  # b ran on
    finished = {r.request_id: r.finished for r in context.written if r.HasField("finished")}
    assert finished["a"].reason == finished["b"].reason == common_pb2.FINISH_REASON_CANCELLED
    errors = [r.finished.error for r in context.written if r.finished.reason == common_pb2.FINISH_REASON_ERROR]
    assert [e.code for e in errors] == [3, 3, 3]  # INVALID_ARGUMENT each
    assert "request_id is required" in errors[0].message and "already in flight" in errors[1].message
    assert "temperature" in errors[2].message
    assert len(core.rejected_ids) == 3 and sorted(core.freed) == ["a", "b"]

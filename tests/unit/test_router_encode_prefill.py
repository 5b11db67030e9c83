"""The router's Encode and Prefill calls when the client leaves while one runs: the call is let answer (not
cancelled), what its answer names is released, and a call that fails afterwards leaves no error behind for
nobody to read ("Task exception was never retrieved … NOT_FOUND: embedding handle … expired", seen in a run)."""
from __future__ import annotations

import asyncio
import contextlib
import gc

import grpc

from common.pb.disagg.v1 import common_pb2, worker_pb2
from services.router.deadline import Deadline
from services.router.encode_prefill import EncodePrefill

EXPIRED = grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               "embedding handle h1 is unknown, released or expired")


class _Pool:
    def __init__(self) -> None:
        self.tasks: list[asyncio.Task] = []

    def spawn(self, coro) -> asyncio.Task:
        self.tasks.append(asyncio.get_running_loop().create_task(coro))
        return self.tasks[-1]


class _Call:
    """A unary call that answers (or fails) after `delay_s`."""

    def __init__(self, outcome, delay_s: float) -> None:
        self._task = asyncio.ensure_future(self._run(outcome, delay_s))

    @staticmethod
    async def _run(outcome, delay_s: float):
        await asyncio.sleep(delay_s)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def __await__(self):
        return self._task.__await__()


class _Images:
    worker_request_id, images = "r1", []


class _Worker:
    endpoint = "prefill:1"

    def __init__(self, call: _Call) -> None:
        self.prefiller = self.encoder = self
        self._call = call

    def Prefill(self, request, timeout=None) -> _Call:
        return self._call

    Encode = Prefill

    busy = prefilling = staticmethod(lambda *_: contextlib.nullcontext())


async def _leave_during(stage: str, outcome) -> tuple[_Pool, list[dict]]:
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    pool = _Pool()
    calls = EncodePrefill(pool, None, "round_robin")
    pool.released = []
    calls.releaser.session = lambda ref: pool.released.append(ref.session_id)
    calls.releaser.embeddings = lambda refs: pool.released.extend(ref.handle for ref in refs)
    worker, deadline = _Worker(_Call(outcome, 0.1)), Deadline.of(0, None)
    request = asyncio.ensure_future(
        calls._prefill_call(worker, None, worker_pb2.PrefillRequest(), deadline) if stage == "prefill"
        else calls.encode(worker, _Images(), deadline))
    await asyncio.sleep(0.02)
    request.cancel()  # the client left
    await asyncio.gather(request, return_exceptions=True)
    await asyncio.sleep(0.2)  # the call answers meanwhile
    await asyncio.gather(*pool.tasks)
    gc.collect()  # an unread task error is reported when the task is collected
    await asyncio.sleep(0)
    return pool, errors


def test_a_prefill_that_fails_after_its_client_left_leaves_no_unread_error():
    pool, errors = asyncio.run(_leave_during("prefill", EXPIRED))
    assert not errors, errors
    assert pool.released == []


def test_a_prefill_that_answers_after_its_client_left_has_its_session_released():
    answer = worker_pb2.PrefillResponse(first_token=5, session=common_pb2.KvSessionRef(session_id="s1"))
    pool, errors = asyncio.run(_leave_during("prefill", answer))
    assert not errors, errors
    assert pool.released == ["s1"]


def test_an_encode_that_answers_after_its_client_left_has_its_embeddings_released():
    """Not cancelled: a cancel that raced the answer lost the refs on the wire while encode held the tensors."""
    answer = worker_pb2.EncodeResponse(embeddings=[common_pb2.EmbeddingRef(handle="e1"),
                                                   common_pb2.EmbeddingRef(handle="e2")])
    pool, errors = asyncio.run(_leave_during("encode", answer))
    assert not errors, errors
    assert pool.released == ["e1", "e2"]

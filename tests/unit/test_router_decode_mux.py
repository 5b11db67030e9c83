"""The router's side of Decoder.DecodeMany (services/router/decode_mux.py) against an in-process worker whose
answers each test scripts: a request looks like its own Decode call (its messages, then the end of iteration or its
status as an AioRpcError), the router's deadline cancels on the worker, a broken stream is UNAVAILABLE for every
request on it and the next request opens a new one. The real worker's side: tests/integration/test_workers.py."""
from __future__ import annotations

import asyncio
from functools import partial
from typing import Callable

import grpc
import pytest

from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.router.decode_mux import DecodeMux
from tests.loopback_grpc import loopback_server

Script = Callable[[worker_pb2.TaggedDecodeClientMessage, "ScriptedWorker"], list[worker_pb2.TaggedDecodeServerMessage]]


def delta(tag: int, *tokens: int) -> worker_pb2.TaggedDecodeServerMessage:
    return worker_pb2.TaggedDecodeServerMessage(tag=tag, message=worker_pb2.DecodeServerMessage(
        delta=common_pb2.Delta(token_ids=tokens)))


def finished(tag: int) -> worker_pb2.TaggedDecodeServerMessage:
    return worker_pb2.TaggedDecodeServerMessage(tag=tag, message=worker_pb2.DecodeServerMessage(
        finished=common_pb2.Finished(reason=common_pb2.FINISH_REASON_LENGTH)))


def end(tag: int, code: grpc.StatusCode = grpc.StatusCode.OK, message: str = "") -> worker_pb2.TaggedDecodeServerMessage:
    return worker_pb2.TaggedDecodeServerMessage(tag=tag, end=worker_pb2.RequestStatus(code=code.value[0],
                                                                                      message=message))


class ScriptedWorker(worker_pb2_grpc.DecoderServicer):
    """Answers each tagged client message with what `script` returns; records what came, and how many streams."""

    def __init__(self, script: Script):
        self.script = script
        self.received: list[worker_pb2.TaggedDecodeClientMessage] = []
        self.streams = 0
        self.break_stream = asyncio.Event()

    async def DecodeMany(self, request_iterator, context):
        self.streams += 1
        outbox: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            async for request in request_iterator:
                for tagged in request.messages:
                    self.received.append(tagged)
                    outbox.put_nowait(self.script(tagged, self))

        reader = asyncio.create_task(read())
        broken = asyncio.create_task(self.break_stream.wait())
        try:
            while True:
                got = asyncio.create_task(outbox.get())
                done, _ = await asyncio.wait({got, broken}, return_when=asyncio.FIRST_COMPLETED)
                if broken in done:
                    got.cancel()
                    self.break_stream.clear()
                    await context.abort(grpc.StatusCode.INTERNAL, "the worker's stream broke")
                entries = got.result()
                if entries:
                    yield worker_pb2.DecodeManyResponse(messages=entries)
        finally:
            reader.cancel()
            broken.cancel()


def run(script: Script, body) -> ScriptedWorker:
    async def main() -> ScriptedWorker:
        worker = ScriptedWorker(script)
        async with loopback_server(partial(worker_pb2_grpc.add_DecoderServicer_to_server, worker)) as (_, address):
            async with grpc.aio.insecure_channel(address) as channel:
                stream = DecodeMux(worker_pb2_grpc.DecoderStub(channel), address)
                try:
                    await body(stream, worker)
                finally:
                    stream.close()
        return worker

    return asyncio.run(main())


def start(request_id: str) -> worker_pb2.DecodeClientMessage:
    return worker_pb2.DecodeClientMessage(start=worker_pb2.DecodeStart(request_id=request_id, token_ids=[1, 2]))


async def collect(call) -> list[worker_pb2.DecodeServerMessage]:
    return [message async for message in call]


def answer_each_start(tagged, worker) -> list:
    """Two tokens, finished and an OK end for every start; nothing for a cancel."""
    if tagged.message.HasField("start"):
        return [delta(tagged.tag, 7), delta(tagged.tag, 8), finished(tagged.tag), end(tagged.tag)]
    return []


def test_requests_share_one_stream_and_each_reads_as_its_own_call():
    async def body(stream: DecodeMux, worker: ScriptedWorker) -> None:
        calls = [stream.request(10.0) for _ in range(3)]
        for i, call in enumerate(calls):
            await call.write(start(f"r{i}"))
        for messages in await asyncio.gather(*map(collect, calls)):
            assert [list(m.delta.token_ids) for m in messages[:2]] == [[7], [8]] and messages[2].HasField("finished")
        assert [call.cancel() for call in calls] == [False] * 3  # each had finished: no cancel is sent

    worker = run(answer_each_start, body)
    assert worker.streams == 1
    assert [t.message.WhichOneof("kind") for t in worker.received] == ["start"] * 3
    assert len({t.tag for t in worker.received}) == 3
    first = worker.received[0]
    assert 9.0 < first.timeout_s <= 10.0  # the request's deadline travels with its start


def test_a_request_ended_with_a_status_raises_it_and_spares_the_others():
    def script(tagged, worker) -> list:
        if tagged.message.start.request_id == "bad":
            return [end(tagged.tag, grpc.StatusCode.FAILED_PRECONDITION, "layout mismatch: bf16 against float32")]
        return answer_each_start(tagged, worker)

    async def body(stream: DecodeMux, worker: ScriptedWorker) -> None:
        bad, good = stream.request(None), stream.request(None)
        await bad.write(start("bad"))
        await good.write(start("good"))
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await collect(bad)
        assert raised.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert raised.value.details() == "layout mismatch: bf16 against float32"
        assert len(await collect(good)) == 3

    run(script, body)


def test_the_routers_deadline_cancels_the_request_on_the_worker():
    async def body(stream: DecodeMux, worker: ScriptedWorker) -> None:
        call = stream.request(0.3)
        await call.write(start("slow"))  # the worker never answers it
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await collect(call)
        assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(100):
            if len(worker.received) == 2:
                break
            await asyncio.sleep(0.01)

    worker = run(lambda tagged, worker: [], body)
    assert [t.message.WhichOneof("kind") for t in worker.received] == ["start", "cancel"]
    assert worker.received[0].tag == worker.received[1].tag


def test_a_broken_stream_is_unavailable_for_each_request_and_the_next_opens_another():
    async def body(stream: DecodeMux, worker: ScriptedWorker) -> None:
        calls = [stream.request(None), stream.request(None)]
        for call in calls:
            await call.write(start("waits"))
        while len(worker.received) < 2:
            await asyncio.sleep(0.01)
        worker.break_stream.set()
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await collect(call)
            assert raised.value.code() is grpc.StatusCode.UNAVAILABLE  # rerouted or migrated, as a lost worker's
            assert "shared Decode stream failed: INTERNAL the worker's stream broke" in raised.value.details()
        worker.script = answer_each_start
        again = stream.request(None)
        await again.write(start("after"))
        assert len(await collect(again)) == 3

    worker = run(lambda tagged, worker: [], body)
    assert worker.streams == 2


def test_a_cancel_mid_stream_reaches_the_worker_once_and_stops_the_reading():
    async def body(stream: DecodeMux, worker: ScriptedWorker) -> None:
        call = stream.request(None)
        await call.write(start("long"))
        first = await anext(aiter(call))
        assert list(first.delta.token_ids) == [7]
        assert call.cancel() is True and call.cancel() is False
        assert await collect(call) == []
        with pytest.raises(asyncio.InvalidStateError):
            await call.write(worker_pb2.DecodeClientMessage(cancel=common_pb2.Cancel(index=0)))
        while len(worker.received) < 2:
            await asyncio.sleep(0.01)

    worker = run(lambda tagged, worker: [delta(tagged.tag, 7)] if tagged.message.HasField("start") else [], body)
    assert [t.message.WhichOneof("kind") for t in worker.received] == ["start", "cancel"]

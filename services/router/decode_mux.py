"""Request path, decode, under decode_stream.py: the router's side of Decoder.DecodeMany, one stream to a decode worker
multiplexing every request this router has there, each request looking like its own Decode call.

gRPC's cost is per message (a read's callback, a write's completion through the poller): with a stream per
request the router reads one message per request per engine step. Here the worker sends what all requests made
while its last write was under way as one message, and the router writes starts and cancels in batches too.
DecodeStream drives a MuxedDecodeCall as it drives a Decode call (write, iterate, cancel), so the request's
logic (refusal, migration, stop strings, cancels) is the same on both.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate

from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class DecodeMux:
    """One DecodeMany stream to one decode worker, opened on first use and again after it breaks."""

    def __init__(self, stub: worker_pb2_grpc.DecoderStub, endpoint: str):
        self._stub = stub
        self._endpoint = endpoint
        self._tags = itertools.count(1)  # never reused: a late entry for an old tag is simply dropped
        self._stream: _Open | None = None

    def request(self, timeout_s: float | None) -> MuxedDecodeCall:
        """A request on the stream, with its deadline; nothing is sent until its first write (the start)."""
        if self._stream is None or self._stream.broken:
            self._stream = _Open(self._stub, self._endpoint)
        return self._stream.register(next(self._tags), timeout_s)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()


class _Open:
    """A DecodeMany call and the two tasks that move its messages."""

    def __init__(self, stub: worker_pb2_grpc.DecoderStub, endpoint: str):
        self.endpoint = endpoint
        self.broken = False
        self.calls: dict[int, MuxedDecodeCall] = {}
        self._outgoing: list[worker_pb2.TaggedDecodeClientMessage] = []
        self._wake = asyncio.Event()
        # The stream outlives the request that opened it: no request's trace or cancellation may reach it.
        context = contextvars.Context()
        self._call = context.run(stub.DecodeMany)
        loop = asyncio.get_running_loop()
        self._writer = loop.create_task(self._write_all(), context=context.copy())
        self._reader = loop.create_task(self._read_all(), context=context.copy())

    def register(self, tag: int, timeout_s: float | None) -> MuxedDecodeCall:
        call = self.calls[tag] = MuxedDecodeCall(self, tag, timeout_s)
        return call

    def send(self, message: worker_pb2.TaggedDecodeClientMessage) -> None:
        self._outgoing.append(message)
        self._wake.set()

    def close(self) -> None:
        self.broken = True
        self._call.cancel()
        self._writer.cancel()

    async def _write_all(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            while True:
                await self._wake.wait()
                self._wake.clear()
                batch, self._outgoing = self._outgoing, []
                await self._call.write(worker_pb2.DecodeManyRequest(messages=batch))

    async def _read_all(self) -> None:
        try:
            async for response in self._call:
                for entry in response.messages:
                    call = self.calls.get(entry.tag)
                    if call is None:
                        continue  # cancelled here already
                    if entry.HasField("end"):
                        del self.calls[entry.tag]
                    call.deliver(entry)
            error = _error(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.endpoint} ended the shared Decode "
                                                        "stream")
        except grpc.aio.AioRpcError as exc:
            # Whatever broke the shared stream, each request on it lost its worker: UNAVAILABLE reroutes or migrates.
            error = exc if exc.code() is grpc.StatusCode.UNAVAILABLE else _error(
                grpc.StatusCode.UNAVAILABLE, f"decode worker {self.endpoint}'s shared Decode stream failed: "
                                             f"{exc.code().name} {exc.details()}")
        except asyncio.CancelledError:
            error = _error(grpc.StatusCode.UNAVAILABLE, "the router closed its stream to decode worker "
                                                        f"{self.endpoint}")
        self.broken = True
        self._writer.cancel()
        calls, self.calls = self.calls, {}
        for call in calls.values():
            call.deliver(error)


class MuxedDecodeCall:
    """One request on a shared stream, with the parts of a Decode call that DecodeStream uses."""

    def __init__(self, stream: _Open, tag: int, timeout_s: float | None):
        self._stream = stream
        self._tag = tag
        loop = asyncio.get_running_loop()
        self._deadline = None if timeout_s is None else loop.time() + timeout_s
        # One timer for the request's deadline (not one per message read): it cancels the request on the worker and
        # ends the reading with DEADLINE_EXCEEDED, as a Decode call's deadline does.
        self._timer = None if self._deadline is None else loop.call_at(self._deadline, self._expire)
        self._inbox: asyncio.Queue[worker_pb2.TaggedDecodeServerMessage | grpc.aio.AioRpcError] = asyncio.Queue()
        self._trace_context: dict[str, str] = {}
        propagate.inject(self._trace_context, otel_context.get_current())  # the caller's span, for the worker's
        self._started = False
        self._finished = False  # the worker sent `finished`
        self._ended = False  # its `end` came, the stream broke, its deadline passed, or it was cancelled here

    def deliver(self, entry: worker_pb2.TaggedDecodeServerMessage | grpc.aio.AioRpcError) -> None:
        self._inbox.put_nowait(entry)

    async def write(self, message: worker_pb2.DecodeClientMessage) -> None:
        if self._ended:
            raise asyncio.InvalidStateError("RPC already finished")
        tagged = worker_pb2.TaggedDecodeClientMessage(tag=self._tag, message=message)
        if not self._started:
            self._started = True
            tagged.trace_context.update(self._trace_context)
            if self._deadline is not None:
                tagged.timeout_s = max(self._deadline - asyncio.get_running_loop().time(), 0.0)
        self._stream.send(tagged)

    def __aiter__(self) -> MuxedDecodeCall:
        return self

    async def __anext__(self) -> worker_pb2.DecodeServerMessage:
        if self._ended and self._inbox.empty():
            raise StopAsyncIteration
        entry = await self._inbox.get()
        if isinstance(entry, grpc.aio.AioRpcError):
            self._end()
            raise entry
        if entry.HasField("message"):
            if entry.message.HasField("finished"):  # its `end` follows: nothing is left to cancel
                self._finished = True
            return entry.message
        self._end()
        if entry.end.code == grpc.StatusCode.OK.value[0]:
            raise StopAsyncIteration
        raise _error(_STATUS_BY_NUMBER.get(entry.end.code, grpc.StatusCode.UNKNOWN), entry.end.message)

    def cancel(self) -> bool:
        """Cancel the request (the worker frees its blocks) and stop reading it; False when it had ended."""
        if self._ended:
            return False
        self._end()
        while not self._inbox.empty():  # what came before the cancel is not read
            self._inbox.get_nowait()
        return True

    def _expire(self) -> None:
        if not self._ended:
            self._end()
            self._inbox.put_nowait(_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _end(self) -> None:
        """No more of this request: its timer stopped, its entries no longer delivered, and, if the worker may still
        be running it, a Cancel sent."""
        self._ended = True
        if self._timer is not None:
            self._timer.cancel()
        if self._stream.calls.pop(self._tag, None) is not None and self._started and not self._finished \
                and not self._stream.broken:
            self._stream.send(worker_pb2.TaggedDecodeClientMessage(
                tag=self._tag, message=worker_pb2.DecodeClientMessage(cancel=common_pb2.Cancel())))

    async def done_writing(self) -> None:
        """Nothing to half-close: the stream is shared."""


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

"""Many requests on one bidirectional stream (GenerateStream, ModelStreamInfer): each request runs in its own task,
and every response is written from one place, until the client half-closed and every request is done. One
request's end never ends another; a malformed message ends the whole stream with InvalidRequest; leaving early (the
call cancelled) cancels every request."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine

from google.protobuf.message import DecodeError

from common.errors import InvalidRequest

class StreamTasks:
    def __init__(self, message_name: str):
        self._message_name = message_name  # the request message, for a parse error
        # A response to write, the error that ends the whole stream, or None: every request is done.
        self._out: asyncio.Queue[Any] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._reading = True

    async def serve(self, requests: AsyncIterator[Any], on_request: Callable[[Any], None],
                    write: Callable[[Any], Awaitable[None]]) -> None:
        """`on_request` takes each request (raising InvalidRequest ends the stream); `write` sends a response.
        Raises InvalidRequest for a malformed message."""
        reader = asyncio.create_task(self._read(requests, on_request))
        try:
            while (item := await self._out.get()) is not None:
                if isinstance(item, InvalidRequest):
                    raise item
                await write(item)
        finally:
            reader.cancel()
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    def send(self, response: Any) -> None:
        self._out.put_nowait(response)

    def start(self, request: Coroutine, on_done: Callable[[asyncio.Task], None] | None = None) -> asyncio.Task:
        """Run one request; `on_done` is called when its task is done (a done callback, not a `finally`: a task
        cancelled before it ever ran has none)."""
        task = asyncio.create_task(request)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, on_done))
        return task

    async def _read(self, requests: AsyncIterator[Any], on_request: Callable[[Any], None]) -> None:
        try:
            async for request in requests:
                on_request(request)
        except InvalidRequest as exc:
            self._out.put_nowait(exc)
        except DecodeError as exc:  # bytes that are no request message: end the stream, not silently
            self._out.put_nowait(InvalidRequest(f"could not parse a {self._message_name}: {exc}"))
        finally:
            self._reading = False
            self._end_if_idle()

    def _done(self, task: asyncio.Task, on_done: Callable[[asyncio.Task], None] | None) -> None:
        self._tasks.discard(task)
        if on_done is not None:
            on_done(task)
        self._end_if_idle()

    def _end_if_idle(self) -> None:
        if not self._reading and not self._tasks:
            self._out.put_nowait(None)

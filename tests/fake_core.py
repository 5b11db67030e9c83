"""A fake router core for the front-door tests (OpenAI HTTP, KServe v2): the contract the front doors call —
served_model, ready, stream (a script of events; an exception in it is raised, HANG waits until cancelled),
rejected — and a record of what they called it with."""
from __future__ import annotations

import asyncio

from common import errors
from services.router.generation import ServedModel

HANG = object()  # in a script: wait until cancelled


class FakeCore:
    def __init__(self, script, *, model: str = "tiny", image_token: str | None = None, ready: bool = True):
        self.script = list(script)
        self.model = ServedModel(model, 128, image_token=image_token)
        self.is_ready = ready
        self.available = True  # False: served_model raises Unavailable, as with no decode worker
        self.requests = []
        self.timeouts = []
        self.rejections = []  # what the front door refused before calling stream (core.rejected)
        self.closed = 0  # streams closed (finished, failed or cancelled)

    def served_model(self) -> ServedModel:
        if not self.available:
            raise errors.Unavailable("no decode worker is ready; the router cannot serve yet")
        return self.model

    def ready(self) -> bool:
        return self.is_ready

    def rejected(self, exc: BaseException) -> None:
        self.rejections.append(exc)

    async def stream(self, request, timeout_s=None):
        self.requests.append(request)
        self.timeouts.append(timeout_s)
        try:
            for item in self.script:
                if item is HANG:
                    await asyncio.sleep(3600)
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed += 1

    async def wait_closed(self, count: int = 1, timeout_s: float = 5.0) -> None:
        """Until `count` streams have closed, or `timeout_s` passed (the caller asserts on `closed`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.closed < count and loop.time() < deadline:
            await asyncio.sleep(0.01)

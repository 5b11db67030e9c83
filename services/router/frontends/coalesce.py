"""A request's events for a front door whose writes can fall behind: the TextDeltas of one choice that came while the
front door was writing go out merged, as one message.

A gRPC write costs the router more than anything else it does per token (a server-streaming write waits for its
completion through gRPC's poller: 36 % of the router's busy time at 1 800 tokens/s in benchmarks/router_cpu.py).
While the router keeps up, every delta is written as it comes, alone, so inter-token latency is untouched; once the
writes fall behind (thousands of tokens/s through one router), the tokens that piled up during one write leave in the
next, and the router's cost per token falls as its load rises instead of its event loop falling further behind.
vLLM's --stream-interval sends every N tokens always; this merges only what is already waiting.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import AsyncIterator

from services.router.generation import Event, TextDelta

_END = object()


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


def merged(first: TextDelta, second: TextDelta) -> TextDelta | None:
    """One delta with both's tokens, text and logprobs; None where they cannot be one (another choice, or the second
    opens its choice: the echo and the prompt's logprobs go in a choice's first delta alone)."""
    if second.index != first.index or second.prompt_token_ids or second.prompt_logprobs:
        return None
    return replace(first, token_ids=first.token_ids + second.token_ids, text=first.text + second.text,
                   logprobs=first.logprobs + second.logprobs)


async def coalesced(events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """`events`, read as they come by a task of its own while the caller handles the last one, with the deltas that
    piled up meanwhile merged (`merged`). The events' errors are raised here; closing this (the caller's client left)
    stops the reading task, which cancels the request as closing `events` would."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for event in events:
                queue.put_nowait(event)
        except Exception as exc:  # raised to the caller, in order
            queue.put_nowait(_Failed(exc))
        else:
            queue.put_nowait(_END)

    reader = asyncio.create_task(pump())
    try:
        held = None
        while True:
            item = held if held is not None else await queue.get()
            held = None
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.exc
            while isinstance(item, TextDelta) and not queue.empty():
                following = queue.get_nowait()
                both = merged(item, following) if isinstance(following, TextDelta) else None
                if both is None:
                    held = following
                    break
                item = both
            yield item
    finally:
        if not reader.done():  # the caller left: the request is cancelled as closing `events` does
            reader.cancel()
            await asyncio.wait([reader])  # its cleanup (the workers' cancels) done; never raises the reader's error

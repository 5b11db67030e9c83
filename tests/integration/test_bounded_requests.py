"""No one request holds up the others: while the largest request the limits allow runs (64 stop strings of 64
characters, each starting with the space that starts most words, and a long max_tokens), another client's request
starts about as fast as it does alone and GET /health answers at once."""
from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
import pytest

from common.engine.request import SamplingParams
from tests.integration.front_doors import Cluster
from tests.integration.leaks import assert_no_leaks

pytestmark = pytest.mark.slow

PROMPT = "The sea is"
NORMAL = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
LARGEST = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True,
           "stop": [f" {i:02d}" + "~" * (64 - 3) for i in range(SamplingParams.MAX_STOP_STRINGS)]}
SLOWDOWN, SLACK_S = 2.0, 0.2  # the loaded TTFT may be twice the unloaded one, plus a little for a 2-core machine
HEALTH_S = 0.1
SAMPLES = 5


async def _ttft(session: aiohttp.ClientSession, url: str) -> float:
    """Seconds to the response's start: a stream starts with its first token's event."""
    started = time.perf_counter()
    async with session.post(url, json=NORMAL) as response:
        ttft = time.perf_counter() - started
        assert response.status == 200, await response.text()
        await response.read()
    return ttft


async def _health(session: aiohttp.ClientSession, url: str) -> float:
    started = time.perf_counter()
    async with session.get(url) as response:
        await response.read()
        assert response.status == 200
    return time.perf_counter() - started


async def _measure(session: aiohttp.ClientSession, http: str) -> tuple[float, float]:
    """The median TTFT and the median /health time over a few tries, one at a time."""
    ttfts = [await _ttft(session, f"{http}/v1/completions") for _ in range(SAMPLES)]
    healths = [await _health(session, f"{http}/health") for _ in range(SAMPLES)]
    return statistics.median(ttfts), statistics.median(healths)


async def _largest_running(session: aiohttp.ClientSession, http: str) -> tuple[aiohttp.ClientResponse, asyncio.Task]:
    """The largest request, streaming, with a reader that takes its events as they come (as a client would)."""
    assert sum(len(s) for s in LARGEST["stop"]) == SamplingParams.MAX_STOP_CHARS
    response = await session.post(f"{http}/v1/completions", json=LARGEST)
    assert response.status == 200, await response.text()
    await response.content.readuntil(b"\n\n")

    async def read() -> bytes:
        return await response.content.read()
    return response, asyncio.create_task(read())


async def _scenario(front_doors: Cluster) -> dict[str, float]:
    async with aiohttp.ClientSession() as session:
        await _ttft(session, f"{front_doors.http}/v1/completions")  # warm: connections, first-call costs
        alone, health_alone = await _measure(session, front_doors.http)
        response, reader = await _largest_running(session, front_doors.http)
        try:
            loaded, health_loaded = await _measure(session, front_doors.http)
            assert not reader.done(), "the largest request ended before the measurement did: raise its max_tokens"
        finally:
            response.close()  # walks away: the router cancels it and frees its KV
            reader.cancel()
    return {"alone": alone, "loaded": loaded, "health_alone": health_alone, "health_loaded": health_loaded}


@pytest.mark.parametrize("front_doors", ["prefill-decode"], indirect=True)
def test_the_largest_request_the_limits_allow_holds_up_no_one(front_doors):
    times = asyncio.run(_scenario(front_doors))
    print({name: f"{s * 1000:.0f} ms" for name, s in times.items()})
    assert times["loaded"] <= SLOWDOWN * times["alone"] + SLACK_S, times
    assert times["health_loaded"] < HEALTH_S, times
    assert_no_leaks(front_doors.workers)

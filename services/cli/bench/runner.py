"""Sends the workload through one front door's client, shaped by rate and concurrency, and times every token."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from common import channels
from common.pb.disagg.v1 import generation_pb2, generation_pb2_grpc
from services.cli.bench.clients import SendOptions, https_context
from services.cli.bench.stats import RequestRecord
from services.cli.bench.workload import BenchRequest, arrival_offsets


@dataclass(frozen=True)
class Sent:
    """What the sending event loops did: every request's record, the wall time from the start to the last end, and
    each loop's busy share (its thread's CPU seconds over the wall seconds it sent for; one a --clients process):
    near 1.0 the client's own loop delayed the tokens it timed, and the figures measure it as much as the server."""

    records: list[RequestRecord]
    duration_s: float
    loop_busy: list[float]


@dataclass(frozen=True)
class LoadShape:
    request_rate: float = float("inf")  # requests/s of a Poisson process; inf sends all at once
    max_concurrency: int | None = None  # requests in flight at most; None = no limit
    seed: int = 0


async def run_load(client, requests: list[BenchRequest], shape: LoadShape, options: SendOptions,
                   progress=None) -> Sent:
    """Every request of `requests` through `client` (services.cli.bench.clients), shaped by `shape`."""
    offsets = arrival_offsets(len(requests), shape.request_rate, shape.seed)
    return await send_scheduled(client, requests, offsets, shape.max_concurrency, options, time.perf_counter(),
                                progress)


async def send_scheduled(client, requests: list[BenchRequest], offsets: list[float], max_concurrency: int | None,
                         options: SendOptions, start: float, progress=None) -> Sent:
    """Request i sent at `start` + offsets[i] (time.perf_counter: CLOCK_MONOTONIC, the same in every process of the
    machine), at most `max_concurrency` in flight; the duration is from `start` to the last end. run_load's
    schedule, and each --clients process's share of it (spread.py)."""
    cpu_at, called_at = time.thread_time(), time.perf_counter()  # this thread runs the loop that times every token
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [RequestRecord(r.index, len(r.prompt_token_ids), r.max_tokens) for r in requests]

    async def one(request: BenchRequest, record: RequestRecord) -> None:
        record.start = time.perf_counter()
        await client.one(request, options, record)
        record.end = time.perf_counter()

    async def send(request: BenchRequest, record: RequestRecord) -> None:
        if limit is None:
            await one(request, record)
        else:
            async with limit:
                await one(request, record)
        if progress is not None:
            progress.update(1)

    tasks = []
    for request, record, offset in zip(requests, records, offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(request, record)))
    await asyncio.gather(*tasks)
    end = time.perf_counter()
    sending = end - max(start, called_at)  # (waiting for `start` costs no CPU)
    busy = (time.thread_time() - cpu_at) / sending if sending > 0 else 0.0
    return Sent(records, end - start, [round(busy, 3)])


async def list_models(target: str, metadata: tuple[tuple[str, str], ...] = ()) -> generation_pb2.ListModelsResponse:
    async with channels.aio_channel(target) as channel:
        return await generation_pb2_grpc.GenerationStub(channel).ListModels(
            generation_pb2.ListModelsRequest(), timeout=30, wait_for_ready=True, metadata=metadata)


async def list_models_http(base_url: str, wait_s: float = 30.0,
                           headers: dict[str, str] | None = None) -> generation_pb2.ListModelsResponse:
    """GET /v1/models of an OpenAI-compatible server (ours, or another such as vLLM's), as ListModels' answer;
    retried until `wait_s` while the server starts."""
    deadline = time.monotonic() + wait_s
    connector = aiohttp.TCPConnector(ssl=https_context(base_url))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), connector=connector) as session:
        while True:
            try:
                async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as response:
                    if 400 <= response.status < 500:  # a wrong key (401): said at once, not retried
                        raise RuntimeError(f"GET /v1/models: HTTP {response.status}: {(await response.text())[:200]}")
                    cards = (await response.json())["data"]
                    break
            except (aiohttp.ClientError, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
    return generation_pb2.ListModelsResponse(models=[
        generation_pb2.ModelInfo(id=card["id"], max_model_len=card.get("max_model_len") or 0) for card in cards])

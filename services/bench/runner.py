"""Sends the workload over Generation.Generate (one RPC per request on one channel) and times every token."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from common import channels
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.bench.stats import RequestRecord
from services.bench.workload import BenchRequest, arrival_gaps


@dataclass(frozen=True)
class LoadShape:
    request_rate: float = float("inf")  # requests/s of a Poisson process; inf sends all at once
    max_concurrency: int | None = None  # requests in flight at most; None = no limit
    seed: int = 0


def build_request(request: BenchRequest, model: str, temperature: float, ignore_eos: bool,
                  run_id: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=f"bench-{run_id}-{request.index}", model=model,
        token_ids=generation_pb2.TokenIds(ids=request.prompt_token_ids),
        sampling=common_pb2.SamplingParams(max_tokens=request.max_tokens, temperature=temperature),
        stop=common_pb2.StopConditions(ignore_eos=ignore_eos),
    )


async def _one(stub, message: generation_pb2.GenerateRequest, record: RequestRecord, timeout_s: float | None) -> None:
    record.start = time.perf_counter()
    try:
        async for response in stub.Generate(message, timeout=timeout_s):
            if response.HasField("delta"):
                if response.delta.token_ids:
                    record.token_times.append(time.perf_counter())
                    record.output_tokens += len(response.delta.token_ids)
            elif response.finished.reason == common_pb2.FINISH_REASON_ERROR:
                record.error = response.finished.error.message or "finished with reason ERROR"
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    record.end = time.perf_counter()


async def run_load(target: str, requests: list[BenchRequest], shape: LoadShape, *, model: str = "",
                   temperature: float = 0.0, ignore_eos: bool = True, timeout_s: float | None = None,
                   run_id: str = "run", progress=None, channel_options=()) -> tuple[list[RequestRecord], float]:
    """Every request of `requests`, shaped by `shape`; returns the records and the wall time from first send to last end."""
    limit = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    records = [RequestRecord(r.index, len(r.prompt_token_ids), r.max_tokens) for r in requests]
    async with channels.aio_channel(target, channel_options) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def send(request: BenchRequest, record: RequestRecord) -> None:
            message = build_request(request, model, temperature, ignore_eos, run_id)
            if limit is None:
                await _one(stub, message, record, timeout_s)
            else:
                async with limit:
                    await _one(stub, message, record, timeout_s)
            if progress is not None:
                progress.update(1)

        start = time.perf_counter()
        tasks = []
        for request, record, gap in zip(requests, records, arrival_gaps(len(requests), shape.request_rate, shape.seed)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(send(request, record)))
        await asyncio.gather(*tasks)
    return records, time.perf_counter() - start


async def list_models(target: str) -> generation_pb2.ListModelsResponse:
    async with channels.aio_channel(target) as channel:
        return await generation_pb2_grpc.GenerationStub(channel).ListModels(generation_pb2.ListModelsRequest(),
                                                                            timeout=30, wait_for_ready=True)

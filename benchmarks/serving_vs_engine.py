"""Serving overhead: router → prefill → decode (real processes, gRPC, KV pull) vs the engine in-process.

    python -m benchmarks.serving_vs_engine [--requests 16] [--output-tokens 64] [--concurrency 1 16]

Same prompts (chat-templated, SmolLM2-135M-Instruct, float32, greedy, ignore_eos) both ways, at each
concurrency: the client keeps that many requests in flight. TTFT is measured at the client (first
streamed token) for the service and at the AsyncLLMEngine consumer for the engine; tokens/s is
all output tokens over the wall time of the run. The engine side is the ceiling for the service
on this machine: the service adds tokenisation, gRPC hops, the KV pull and detokenisation, and on
a machine with few cores its three processes share the CPUs the engine has to itself.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass

import grpc

from common.engine.async_engine import AsyncLLMEngine
from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import LLMEngine
from common.engine.interface import EngineRequest
from common.engine.request import SamplingParams
from common.tokenizer import Tokenizer
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from benchmarks.engine_vs_hf import make_prompts
from benchmarks.processes import start_services


@dataclass
class RunStats:
    tokens: int
    seconds: float
    ttfts: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def ttft_ms(self, q: float) -> float:
        return statistics.quantiles(self.ttfts, n=100, method="inclusive")[int(q) - 1] * 1000 if len(
            self.ttfts) > 1 else self.ttfts[0] * 1000


async def _bounded(concurrency: int, jobs):
    gate = asyncio.Semaphore(concurrency)

    async def run(job):
        async with gate:
            return await job()

    return await asyncio.gather(*(run(job) for job in jobs))


async def bench_service(address: str, prompts: list[list[int]], out_tokens: int, concurrency: int) -> RunStats:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(prompt: list[int]):
            request = generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=prompt),
                sampling=common_pb2.SamplingParams(temperature=0, max_tokens=out_tokens),
                stop=common_pb2.StopConditions(ignore_eos=True))
            start, first, tokens = time.perf_counter(), None, 0
            async for response in stub.Generate(request):
                if response.HasField("delta") and response.delta.token_ids:
                    first = first or time.perf_counter()
                    tokens += len(response.delta.token_ids)
            return tokens, first - start

        await one(prompts[0])  # warm-up: connections, first batch shapes
        start = time.perf_counter()
        results = await _bounded(concurrency, [lambda p=p: one(p) for p in prompts])
        return RunStats(sum(r[0] for r in results), time.perf_counter() - start, [r[1] for r in results])


async def bench_engine(engine: AsyncLLMEngine, prompts: list[list[int]], out_tokens: int,
                       concurrency: int, tag: str) -> RunStats:
    sampling = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)

    async def one(i: int, prompt: list[int]):
        start, first, tokens = time.perf_counter(), None, 0
        async for out in engine.generate(EngineRequest(f"{tag}-{i}", prompt, sampling)):
            if out.new_token_ids:
                first = first or time.perf_counter()
                tokens += len(out.new_token_ids)
        return tokens, first - start

    await one(-1, prompts[0])
    start = time.perf_counter()
    results = await _bounded(concurrency, [lambda i=i, p=p: one(i, p) for i, p in enumerate(prompts)])
    return RunStats(sum(r[0] for r in results), time.perf_counter() - start, [r[1] for r in results])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    model = str(default_model_dir())
    prompts = make_prompts(Tokenizer.from_model_dir(model), args.requests)
    # Prefix caching would let repeated runs skip prefill; every run gets fresh prompts instead.
    runs = {c: [[1000 + 7 * c + i % 50] + p for i, p in enumerate(prompts)] for c in args.concurrency}
    print(f"SmolLM2-135M-Instruct float32 on {os.cpu_count()} CPUs: {args.requests} requests, "
          f"prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.output_tokens} output tokens each")

    workers = start_services([("prefill", ("--model", model)), ("decode", ("--model", model))])
    processes = list(workers)
    service: dict[int, RunStats] = {}
    try:
        processes += start_services([("router", ("--model", model, "--prefill-workers", workers[0].address,
                                                 "--decode-workers", workers[1].address))])
        for c in args.concurrency:
            service[c] = asyncio.run(bench_service(processes[-1].address, runs[c], args.output_tokens, c))
    finally:
        for process in processes:
            process.stop()

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=model, max_num_seqs=max(args.concurrency))))
    local: dict[int, RunStats] = {}
    try:
        for c in args.concurrency:
            shifted = [[t + 1 for t in p[:1]] + p[1:] for p in runs[c]]
            local[c] = asyncio.run(bench_engine(engine, shifted, args.output_tokens, c, f"c{c}"))
    finally:
        engine.shutdown()

    print(f"{'concurrency':>11} {'path':>22} {'tok/s':>8} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12}")
    for c in args.concurrency:
        for name, stats in (("router→prefill→decode", service[c]), ("engine in-process", local[c])):
            print(f"{c:>11} {name:>22} {stats.tokens_per_s:>8.1f} {stats.ttft_ms(50):>12.1f} {stats.ttft_ms(90):>12.1f}")
        s, e = service[c], local[c]
        print(f"{c:>11} {'service / engine':>22} {s.tokens_per_s / e.tokens_per_s:>8.2f} "
              f"{s.ttft_ms(50) / e.ttft_ms(50):>12.2f} {s.ttft_ms(90) / e.ttft_ms(90):>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

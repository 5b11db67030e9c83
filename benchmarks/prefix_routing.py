"""Shared-prefix workload: round_robin vs kv_aware routing over two prefill workers (and one decode).

    python -m benchmarks.prefix_routing [--prefixes 4] [--questions 8] [--prefix-len 384] [--concurrency 4]

Like SGLang's generated-shared-prefix dataset: a few long system prompts, many short questions
after each, sent in a shuffled order. Each policy gets fresh workers (cold caches) and the
same requests. Prints, per policy: TTFT (client-side, mean / p50 / p90), prompt tokens the prefill
workers actually computed (prompt − cached_prompt_tokens from Finished.usage), and the ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import grpc

from common.engine.default_model import default_model_dir
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from benchmarks.processes import start_services


def make_requests(prefixes: int, questions: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 40_000) for _ in range(prefix_len)] for _ in range(prefixes)]
    requests = [systems[p] + [rng.randrange(100, 40_000) for _ in range(rng.randrange(8, 32))]
                for q in range(questions) for p in range(prefixes)]
    rng.shuffle(requests)  # arrival order does not follow the prefixes
    return requests


async def _run(address: str, prompts: list[list[int]], concurrency: int) -> list[tuple[float, int, int]]:
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(prompt: list[int]) -> tuple[float, int, int]:
            async with gate:
                request = generation_pb2.GenerateRequest(
                    token_ids=generation_pb2.TokenIds(ids=prompt),
                    sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4),
                    stop=common_pb2.StopConditions(ignore_eos=True))
                start, first, finished = time.perf_counter(), None, None
                async for response in stub.Generate(request, timeout=600):
                    if response.HasField("delta") and first is None:
                        first = time.perf_counter()
                    if response.HasField("finished"):
                        finished = response.finished
                return first - start, finished.usage.prompt_tokens, finished.usage.cached_prompt_tokens

        return await asyncio.gather(*(one(p) for p in prompts))


def bench(policy: str, model: str, prompts: list[list[int]], concurrency: int) -> list[tuple[float, int, int]]:
    env = {"OMP_NUM_THREADS": "1"}
    workers = start_services([("prefill", ("--model", model)), ("prefill", ("--model", model)),
                              ("decode", ("--model", model))], env=env)
    processes = list(workers)
    try:
        processes += start_services([("router", ("--model", model, "--policy", policy,
                                                 "--prefill-workers", f"{workers[0].address},{workers[1].address}",
                                                 "--decode-workers", workers[2].address))], env=env)
        asyncio.run(_run(processes[-1].address, [[7, 7, 7, 7]], 1))  # warm-up: connections, KV subscriptions
        time.sleep(1.0)
        return asyncio.run(_run(processes[-1].address, prompts, concurrency))
    finally:
        for process in processes:
            process.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=384)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    model = args.model or str(default_model_dir())
    prompts = make_requests(args.prefixes, args.questions, args.prefix_len)
    print(f"{len(prompts)} requests: {args.prefixes} system prompts of {args.prefix_len} tokens, "
          f"{args.questions} questions each; concurrency {args.concurrency}; 2 prefill + 1 decode; {model}")
    results = {policy: bench(policy, model, prompts, args.concurrency) for policy in ("round_robin", "kv_aware")}
    print(f"{'policy':>12} {'TTFT mean ms':>13} {'p50 ms':>8} {'p90 ms':>8} {'prompt tok':>11} {'computed tok':>13}")
    summary = {}
    for policy, rows in results.items():
        ttfts = [r[0] * 1000 for r in rows]
        prompt = sum(r[1] for r in rows)
        computed = sum(r[1] - r[2] for r in rows)
        p90 = statistics.quantiles(ttfts, n=10)[-1]
        summary[policy] = (statistics.mean(ttfts), computed)
        print(f"{policy:>12} {statistics.mean(ttfts):>13.1f} {statistics.median(ttfts):>8.1f} {p90:>8.1f} "
              f"{prompt:>11} {computed:>13}")
    (rr_ttft, rr_computed), (kv_ttft, kv_computed) = summary["round_robin"], summary["kv_aware"]
    print(f"kv_aware / round_robin: TTFT mean {kv_ttft / rr_ttft:.2f}x, prefill tokens computed "
          f"{kv_computed / rr_computed:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

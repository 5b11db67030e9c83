"""A 3-token request's TTFT while the engine recomputes a 7.7k-token prompt on the CPU (issue #23: under 1 s).

    python -m benchmarks.long_prefill_ttft [--thresholds 64 128 none] [--dtype float32]

The long prompt is a generation_only request with no KV to import (decode's fallback after a failed prefill),
so the engine prefills it itself. Two short requests are timed once it is 256 tokens in and two at 2048 (its
chunks grow slower with the context), for each prefill chunk limit (`--long-prefill-token-threshold`); "none"
is the peer: one chunk per step up to the whole step budget, as on CUDA, where the short request waits.
That the short request is admitted in the very next step is pinned without a clock in
tests/unit/test_scheduler_long_prefill.py; this script gives the seconds, which depend on the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time

from common.engine.async_engine import AsyncLLMEngine
from common.engine.config import CPU_LONG_PREFILL_TOKENS, EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.interface import EngineRequest
from common.engine.request import RequestType, SamplingParams

LONG_PROMPT_TOKENS = 7700
DEPTHS = (256, 2048)
TTFT_BOUND_S = 1.0  # issue #23


async def _ttft(engine: AsyncLLMEngine, request_id: str) -> float:
    start = time.monotonic()
    async for _ in engine.generate(EngineRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=1))):
        return time.monotonic() - start
    raise RuntimeError(f"{request_id} produced no output")


async def _recompute_long_prompt(engine: AsyncLLMEngine) -> None:
    prompt = [random.Random(0).randrange(100, 40000) for _ in range(LONG_PROMPT_TOKENS)]
    recompute = EngineRequest("long", prompt, SamplingParams(max_tokens=4), RequestType.GENERATION_ONLY,
                              first_token=prompt[-1])  # no KV to import: the engine recomputes the prompt
    async for _ in engine.generate(recompute):
        pass


async def _computed(engine: AsyncLLMEngine, long: asyncio.Task) -> int:
    if long.done():
        return LONG_PROMPT_TOKENS
    return await engine.call(lambda e: e.requests["long"].num_computed_tokens if "long" in e.requests else 0)


async def measure(engine: AsyncLLMEngine) -> dict[int, list[float]]:
    """Short requests' TTFTs by how deep the long prefill was when they arrived."""
    long = asyncio.create_task(_recompute_long_prompt(engine))
    ttfts: dict[int, list[float]] = {}
    try:
        for depth in DEPTHS:
            while await _computed(engine, long) < depth:
                await asyncio.sleep(0.02)
            ttfts[depth] = [await _ttft(engine, f"short-{depth}-{i}") for i in range(2)]
    finally:
        long.cancel()  # leaving its stream aborts the long request
        with contextlib.suppress(asyncio.CancelledError):
            await long
    return ttfts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--thresholds", nargs="+", default=["64", str(CPU_LONG_PREFILL_TOKENS), "none"],
                        help="prefill chunk limits to compare; 'none' = no limit below the step budget")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    print(f"3-token request behind a {LONG_PROMPT_TOKENS}-token recompute, SmolLM2-135M, {args.dtype}, CPU "
          f"(issue #23 bound: {TTFT_BOUND_S:.1f} s; default chunk {CPU_LONG_PREFILL_TOKENS})")
    print(f"{'chunk':>6} " + " ".join(f"{'TTFT@' + str(d):>14}" for d in DEPTHS) + f" {'median':>8} {'worst':>8}")
    for threshold in args.thresholds:
        limit = None if threshold == "none" else int(threshold)
        config = EngineConfig(model=str(default_model_dir()), dtype=args.dtype, num_kv_blocks=600,
                              long_prefill_token_threshold=limit or 2048)
        engine = AsyncLLMEngine.from_config(config)
        try:
            ttfts = asyncio.run(measure(engine))
        finally:
            engine.shutdown()
        cells = " ".join(f"{'/'.join('%.2f' % t for t in ttfts[d]):>14}" for d in DEPTHS)
        every = [t for d in DEPTHS for t in ttfts[d]]
        print(f"{threshold:>6} {cells} {statistics.median(every):>7.2f}s {max(every):>7.2f}s")


if __name__ == "__main__":
    main()

"""Issue #23: while decode recomputes a 7.7k-token prompt itself (the fallback after a failed prefill:
generation_only without imported KV), an unrelated 3-token request still gets its first token within 1 s
on the CPU. The long prompt runs in chunks of long_prefill_token_threshold tokens (scheduler.py), so every
step is short and a new prompt is admitted in the next one; before, one 2048-token chunk held each step for
seconds and the short request waited for the whole prefill."""
import asyncio
import contextlib
import random
import time

import pytest

from common.engine.async_engine import AsyncLLMEngine
from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.interface import EngineRequest
from common.engine.request import RequestType, SamplingParams

pytestmark = pytest.mark.slow

LONG_PROMPT_TOKENS = 7700
TTFT_BOUND_S = 1.0  # the bound


async def _ttft(engine: AsyncLLMEngine, request_id: str) -> float:
    start = time.monotonic()
    async for _ in engine.generate(EngineRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=1))):
        return time.monotonic() - start
    raise AssertionError(f"{request_id} produced no output")


async def _recompute_long_prompt(engine: AsyncLLMEngine) -> None:
    prompt = [random.Random(0).randrange(100, 40000) for _ in range(LONG_PROMPT_TOKENS)]
    recompute = EngineRequest("long", prompt, SamplingParams(max_tokens=4), RequestType.GENERATION_ONLY,
                              first_token=prompt[-1])  # no KV to import: decode recomputes the prompt
    async for _ in engine.generate(recompute):
        pass


async def _computed(engine: AsyncLLMEngine, long: asyncio.Task) -> int:
    """The long prompt's tokens in the KV cache (all of them once its request is over)."""
    if long.done():
        return LONG_PROMPT_TOKENS
    return await engine.call(lambda e: e.requests["long"].num_computed_tokens if "long" in e.requests else 0)


async def _measure_while_long_prefills(engine: AsyncLLMEngine) -> tuple[list[float], int]:
    """Two short requests once the long prefill is under way, two more deeper in (its steps grow with the context)."""
    long = asyncio.create_task(_recompute_long_prompt(engine))
    ttfts = []
    for depth in (256, 2048):
        while await _computed(engine, long) < depth:
            await asyncio.sleep(0.05)
        ttfts += [await _ttft(engine, f"short-{depth}-{i}") for i in range(2)]
    computed = await _computed(engine, long)
    long.cancel()  # leaving its stream aborts the long request
    with contextlib.suppress(asyncio.CancelledError):
        await long
    return ttfts, computed


def test_short_request_ttft_stays_under_1s_while_a_7k_prompt_is_recomputed_on_the_cpu():
    engine = AsyncLLMEngine.from_config(EngineConfig(model=str(default_model_dir()), num_kv_blocks=600))
    try:
        ttfts, computed = asyncio.run(_measure_while_long_prefills(engine))
    finally:
        engine.shutdown()
    assert computed < LONG_PROMPT_TOKENS, "the long prompt finished prefilling: nothing was measured behind it"
    # The bound on the typical short request; a single slower one (another process taking a core on a
    # 2-core machine) may not turn it into a flaky test, yet twice the bound still fails.
    shown = f"TTFTs {['%.2f' % t for t in ttfts]} s behind a {computed}-token prefill"
    assert sorted(ttfts)[len(ttfts) // 2] < TTFT_BOUND_S and max(ttfts) < 2 * TTFT_BOUND_S, shown

"""The asyncio bridge: concurrent streams, abort from another coroutine, errors before the first token."""
import asyncio
import threading
import time

import pytest

from common.engine.async_engine import AsyncLLMEngine
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.interface import EngineRequest
from common.engine.request import FinishReason, SamplingParams
from common.errors import InvalidRequest

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def engines(tiny_llama):
    config = EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=128)
    async_engine = AsyncLLMEngine(LLMEngine(config))
    yield async_engine, LLMEngine(config)
    async_engine.shutdown()


async def _collect(engine: AsyncLLMEngine, rid: str, prompt: list[int]) -> list[int]:
    tokens = []
    async for out in engine.generate(EngineRequest(rid, prompt, GREEDY)):
        tokens.extend(out.new_token_ids)
    return tokens


def test_concurrent_streams_match_the_sync_engine(engines):
    async_engine, sync_engine = engines
    prompts = [list(range(3 + i, 12 + 2 * i)) for i in range(6)]

    async def main():
        return await asyncio.gather(*(_collect(async_engine, f"r{i}", p) for i, p in enumerate(prompts)))

    assert asyncio.run(main()) == sync_engine.generate(prompts, GREEDY)


def test_abort_from_another_coroutine_ends_the_stream_and_frees_blocks(engines):
    async_engine, _ = engines

    async def main():
        outputs = []
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        async for out in async_engine.generate(EngineRequest("long", list(range(3, 40)), long)):
            outputs.append(out)
            if len(outputs) == 3:
                assert await async_engine.abort("long")
        return outputs, await async_engine.call(lambda e: e.block_manager.num_free_blocks)

    outputs, free = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.ABORT
    assert free == 128


def test_consumer_leaving_early_aborts_the_request(engines):
    async_engine, _ = engines

    async def main():
        stream = async_engine.generate(EngineRequest("leaver", list(range(3, 40)),
                                                     SamplingParams(max_tokens=400, ignore_eos=True)))
        async for _ in stream:
            break
        await stream.aclose()
        await asyncio.sleep(0.05)
        return await async_engine.call(lambda e: (e.block_manager.num_free_blocks, e.has_unfinished_requests()))

    assert asyncio.run(main()) == (128, False)


def test_bad_request_raises_before_any_output_and_the_loop_keeps_serving(engines):
    async_engine, _ = engines

    async def main():
        with pytest.raises(InvalidRequest, match="prompt is empty"):
            await _collect(async_engine, "bad", [])
        return await _collect(async_engine, "good", [5, 6, 7])

    assert len(asyncio.run(main())) == 8


def test_a_call_cancelled_before_its_turn_is_skipped_and_the_loop_lives_on(engines):
    """A cancelled caller must neither run its command late nor kill the engine thread."""
    async_engine, _ = engines
    gate, ran = threading.Event(), []

    async def main():
        blocker = asyncio.ensure_future(async_engine.call(lambda e: gate.wait(10)))
        skipped = asyncio.ensure_future(async_engine.call(lambda e: ran.append("late")))
        await asyncio.sleep(0.05)
        skipped.cancel()
        await asyncio.sleep(0.05)
        gate.set()
        await blocker
        return await _collect(async_engine, "after", list(range(3, 12)))

    tokens = asyncio.run(main())
    assert ran == [] and len(tokens) == GREEDY.max_tokens


def test_each_steps_outputs_report_how_long_they_waited_for_the_event_loop(engines):
    # The worker's disagg_engine_output_wait_seconds: one observation a step's delivery, taken on the loop. A loop
    # kept busy (a blocking callback) while the engine steps shows as waits at least that long.
    async_engine, _ = engines
    waits: list[tuple[float, int]] = []
    async_engine.output_wait = lambda seconds: waits.append((seconds, threading.get_ident()))

    async def main():
        stream = _collect(async_engine, "w", list(range(3, 12)))
        task = asyncio.ensure_future(stream)
        await asyncio.sleep(0)
        time.sleep(0.2)  # the loop busy: the engine's first outputs wait for it
        return await task, threading.get_ident()

    tokens, loop_thread = asyncio.run(main())
    assert len(tokens) == GREEDY.max_tokens
    assert 1 <= len(waits) <= GREEDY.max_tokens  # one a step at most (a step's outputs go in one call)
    assert all(thread == loop_thread and seconds >= 0 for seconds, thread in waits)
    assert max(seconds for seconds, _ in waits) >= 0.05


def test_each_step_reports_what_it_ran_and_the_period_it_closed_on_the_engine_thread(engines):
    # The worker's disagg_engine_step_* metrics: a prompt step first (it closes no period: the engine was idle
    # before it), then decode steps, each closing the period begun by the step before it.
    async_engine, _ = engines
    steps: list[tuple] = []
    async_engine.step_done = lambda step, wall, cpu, period: steps.append(
        (step, wall, cpu, period, threading.current_thread().name))

    tokens = asyncio.run(_collect(async_engine, "s", list(range(3, 12))))
    assert len(tokens) == GREEDY.max_tokens
    assert steps[0][0].kind == "prefill" and steps[0][3] is None
    assert {step.kind for step, *_ in steps[1:]} == {"decode"} and all(s[0].sequences == 1 for s in steps)
    assert all(wall >= 0 and cpu >= 0 and thread == "engine-loop" for _, wall, cpu, _, thread in steps)
    for (before, *_), (_, _, _, period, _) in zip(steps, steps[1:]):
        assert period is not None and period[0] is before and period[1] > 0

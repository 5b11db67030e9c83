"""Driving an in-process engine for the benches: prompts, the device sync, and the median decode step.

fp8.py and moe.py time decode steps with decode_step_ms; cpu_step.py builds its prompts and tells prefill steps
from decode steps with tokens and decoding.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams

PROMPT = 128  # decode_step_ms's prompt length
DECODE_STEPS = 32


def sync(engine: LLMEngine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def tokens(engine: LLMEngine, n: int, seed: int) -> list[int]:
    return [3 + (7919 * seed + 13 * j) % (engine.vocab_size - 3) for j in range(n)]


def decoding(engine: LLMEngine) -> bool:
    """Whether the next step decodes only: nothing waits and every running request has its prompt computed."""
    return not engine.scheduler.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens
                                                for r in engine.scheduler.running)


def decode_step_ms(engine: LLMEngine, batch: int) -> float:
    """The median decode step of `batch` requests of PROMPT tokens, DECODE_STEPS output tokens each."""
    prompts = [tokens(engine, PROMPT, i) for i in range(batch)]
    sampling = SamplingParams(temperature=0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", prompt, sampling)
    return 1e3 * statistics.median(decode_steps(engine))


def decode_steps(engine: LLMEngine, after_step: Callable[[bool], None] = lambda decode: None) -> list[float]:
    """Step `engine` until its requests end: each decode step's wall time (seconds, the device synced);
    `after_step(decode)` runs after every step, told whether it was a decode step."""
    steps = []
    while engine.has_unfinished_requests():
        decode = decoding(engine)
        start = time.perf_counter()
        engine.step()
        sync(engine)
        if decode:
            steps.append(time.perf_counter() - start)
        after_step(decode)
    return steps

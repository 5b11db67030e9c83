"""Measures a profile with the real engine, in this process (common.engine.start and the Engine interface):

- prefill: b prompts of L random tokens sent together to an idle engine, one token each; the seconds from the
  first one's scheduling to the last one's first token (the engine's own stamps where it gives them);
- decode: b requests of context c decoding together; the seconds a step, from the tokens' arrival while every row
  is decoding;
- the handoff (an engine whose KV our data plane moves): a prompt prefilled context-only, then its blocks gathered
  out of the paged cache (the export) and copied into blocks reserved for it (the import): the same-host copy; the
  RPC hops around it are not in it.

A unit is what one worker runs on: "gpus=T" (a worker of tensor-parallel size T on cuda:0..T-1), or "cores=K" (a CPU
worker whose model has K cores, as `disagg up` would pin it).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Iterator

from common.cpu_cores import MODEL_CORES_ENV, format_cores
from common.engine.config import EngineConfig
from common.engine.interface import Engine, EngineRequest, KvSessionHost
from common.engine.request import RequestType, SamplingParams
from common.engine.start import start_engine
from services.planner.profile import Limits, UnitProfile

_TOKENS = (100, 1000)  # random prompt ids from this range: in every vocabulary we serve, never special


@dataclass(frozen=True)
class Grid:
    """What is measured: prompt lengths and batches for prefill, batches and contexts for decode (each point kept
    under `max_tokens` prompt tokens at once and the KV cache), decode steps timed a point, and repeats."""

    lengths: tuple[int, ...]
    batches: tuple[int, ...]
    decode_batches: tuple[int, ...]
    contexts: tuple[int, ...]
    max_tokens: int
    decode_steps: int = 16
    repeats: int = 2

    @classmethod
    def for_device(cls, device: str) -> "Grid":
        if device.startswith("cuda"):
            return cls((128, 512, 2048, 8192), (1, 4, 16), (1, 16, 64, 128), (256, 2048, 8192), 131072)
        return cls((64, 256, 1024), (1, 4), (1, 4, 16), (64, 512), 8192)

    @classmethod
    def parse(cls, text: str, device: str) -> "Grid":
        """`lengths=64,256;batches=1,2;decode_batches=1,4;contexts=64;max_tokens=4096;decode_steps=8;repeats=1`,
        each key over the device's default."""
        base = cls.for_device(device)
        fields = {}
        for part in filter(None, (p.strip() for p in text.split(";"))):
            key, _, value = part.partition("=")
            numbers = tuple(int(v) for v in value.split(",") if v.strip())
            if key not in cls.__dataclass_fields__ or not numbers:
                raise ValueError(f"--profile-grid: unknown key or empty value in {part!r}")
            fields[key] = numbers if isinstance(getattr(base, key), tuple) else numbers[0]
        return cls(**{**base.__dict__, **fields})


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*_TOKENS) for _ in range(n)]


async def _first_tokens(engine: Engine, prompts: list[list[int]], tag: str) -> float:
    """Seconds from the first prompt's scheduling to the last one's first token."""
    sent = time.monotonic()
    stamps: list[tuple[float, float]] = []

    async def one(i: int, prompt: list[int]) -> None:
        request = EngineRequest(f"{tag}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        async for out in engine.generate(request):
            if out.new_token_ids:
                stamps.append((out.first_scheduled_time or sent, out.first_token_time or time.monotonic()))

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return max(t for _, t in stamps) - min(s for s, _ in stamps)


async def _decode_step(engine: Engine, prompts: list[list[int]], steps: int, tag: str) -> float:
    """Seconds a decode step while every request of `prompts` decodes: the median over the requests of (time
    between two of its tokens) in the window where all of them are past their first token and none has ended."""
    arrivals: dict[int, list[float]] = {i: [] for i in range(len(prompts))}

    async def one(i: int, prompt: list[int]) -> None:
        sampling = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
        async for out in engine.generate(EngineRequest(f"{tag}-{i}", prompt, sampling)):
            arrivals[i].extend([time.monotonic()] * len(out.new_token_ids))

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    start = max(times[1] for times in arrivals.values())
    end = min(times[-1] for times in arrivals.values())
    per_row = []
    for times in arrivals.values():
        inside = [t for t in times if start <= t <= end]
        if len(inside) >= 2:
            per_row.append((inside[-1] - inside[0]) / (len(inside) - 1))
    return statistics.median(per_row) if per_row else (end - start) / max(steps, 1)


async def _handoff(engine: Engine, prompt: list[int], tag: str) -> float | None:
    """Seconds to gather a prefilled prompt's KV blocks out of the cache and copy them into reserved ones."""
    if not isinstance(engine, KvSessionHost):
        return None
    import torch

    from common.kv.blocks import gather_blocks

    # (a prompt whose first token ends it, max_tokens=1, pins no session: room for more)
    request = EngineRequest(tag, prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                            request_type=RequestType.CONTEXT_ONLY)
    session_id = None
    async for out in engine.generate(request):
        session_id = out.session_id or session_id
    if session_id is None:
        return None
    try:
        ids = await engine.lease_session(session_id)
        blocks = await engine.kv_blocks()
        target = blocks.reserve(len(ids))
        if target is None:
            return None
        try:
            sync = torch.cuda.synchronize if blocks.cache.is_cuda else (lambda: None)
            sync()
            started = time.perf_counter()
            gathered = gather_blocks(blocks.cache, ids)
            blocks.cache[:, :, target] = gathered
            sync()
            return time.perf_counter() - started
        finally:
            blocks.free(target)
            await engine.end_lease(session_id)
    finally:
        await engine.release_session(session_id)


@contextlib.contextmanager
def unit_environment(unit: str, config: EngineConfig) -> Iterator[EngineConfig]:
    """The engine config and this process's threads for one unit: "gpus=T" is TP size T from cuda:0; "cores=K"
    pins the engine's model thread to the first K cores of this process, a torch thread a core."""
    kind, _, size = unit.partition("=")
    if kind == "gpus":
        yield config.replace(device="cuda:0" if int(size) == 1 else "cuda", tensor_parallel_size=int(size))
        return
    import torch

    cores = tuple(sorted(os.sched_getaffinity(0)))[:int(size)] if hasattr(os, "sched_getaffinity") else ()
    saved_env, saved_threads = os.environ.get(MODEL_CORES_ENV), torch.get_num_threads()
    if cores:
        os.environ[MODEL_CORES_ENV] = format_cores(cores)
    torch.set_num_threads(int(size))
    try:
        yield config
    finally:
        torch.set_num_threads(saved_threads)
        if saved_env is None:
            os.environ.pop(MODEL_CORES_ENV, None)
        else:
            os.environ[MODEL_CORES_ENV] = saved_env


async def measure(engine: Engine, grid: Grid, log=print) -> tuple[UnitProfile, Limits]:
    facts, load = await engine.facts(), await engine.load()
    config = facts.config
    limits = Limits(config.max_num_batched_tokens, config.prefill_chunk_limit, config.max_num_seqs,
                    facts.max_model_len)
    kv_tokens = int(load.kv_blocks_total * config.block_size * 0.8)
    rng = random.Random(0)
    longest = facts.max_model_len - grid.decode_steps - 4
    lengths = sorted({min(n, longest) for n in grid.lengths})
    unit = UnitProfile()
    await _first_tokens(engine, [_prompt(rng, lengths[0])], "warm-prefill")  # (first calls: allocator, caches)
    await _decode_step(engine, [_prompt(rng, lengths[0])], grid.decode_steps, "warm-decode")
    for n in lengths:
        for b in grid.batches:
            if b * n > min(grid.max_tokens, kv_tokens):
                continue
            seconds = min([await _first_tokens(engine, [_prompt(rng, n) for _ in range(b)], f"p{n}x{b}r{r}")
                           for r in range(grid.repeats)])
            unit.prefill.append({"batch": b, "prompt_len": n, "seconds": seconds})
            log(f"  prefill {b} x {n} tokens: {seconds * 1e3:.1f} ms")
    for c in sorted({min(c, longest) for c in grid.contexts}):
        for b in (b for b in grid.decode_batches if b <= config.max_num_seqs):
            if b * c > grid.max_tokens or b * (c + grid.decode_steps + 2) > kv_tokens:
                continue
            step = min([await _decode_step(engine, [_prompt(rng, c) for _ in range(b)], grid.decode_steps,
                                           f"d{c}x{b}r{r}") for r in range(grid.repeats)])
            unit.decode.append({"batch": b, "context": c + grid.decode_steps // 2, "step_s": step})
            log(f"  decode {b} rows at context {c}: {step * 1e3:.2f} ms a step")
    for n in lengths:
        seconds = [s for r in range(grid.repeats) if (s := await _handoff(engine, _prompt(rng, n), f"h{n}r{r}"))
                   is not None]
        if seconds:
            unit.handoff.append({"tokens": n, "seconds": min(seconds)})
            log(f"  handoff of {n} tokens' KV: {min(seconds) * 1e3:.2f} ms")
    return unit, limits


def profile_unit(config: EngineConfig, unit: str, grid: Grid, log=print) -> tuple[UnitProfile, Limits]:
    """Start the engine for `unit`, measure it, shut it down."""
    with unit_environment(unit, config) as unit_config:
        engine = start_engine(unit_config)
        try:
            return asyncio.run(measure(engine, grid, log))
        finally:
            engine.shutdown()

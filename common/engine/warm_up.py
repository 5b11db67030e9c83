"""Requests a fresh engine runs before its worker says SERVING, so that the first real ones find warm what they take: on
a GPU the Triton kernels of each prompt size (compiled and autotuned at their first launch), the sampler's paths, a
grammar mask and its backend's tokenizer tables. The CPU has nothing of the kind to build (its C kernels are
built at import), so none run there. Their KV leaves no trace: the prefix cache is emptied after them, so no worker ever
reports (or serves) a block of theirs."""
from __future__ import annotations

import dataclasses
import logging
import time

from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from common.engine.structured import JSON_OBJECT, StructuredOutput
from common.errors import FailedPrecondition

log = logging.getLogger(__name__)

PROMPT_TOKENS = (16, 128, 512, 2048, 8192)  # prompt (and chunk) sizes whose kernels a GPU builds at first use
# Triton compiles a kernel once for integer arguments divisible by 16 and again for the rest: each size above runs
# one token short too, so the second variant is built here rather than in the first request of an odd length.
ODD_BY = 1
DECODE_BATCH = 32  # short prompts decoded together: the sampler's batched paths
# Each way a request can be sampled, as changes to a greedy request: the sampler's paths, each run alone once.
SAMPLING_WAYS: dict[str, dict] = {
    "greedy-logprob": dict(logprobs=True),
    "greedy-top-1": dict(logprobs=True, top_logprobs=1),
    "greedy-top-5": dict(logprobs=True, top_logprobs=5),
    "prompt-logprobs": dict(prompt_logprobs=1),
    "sampled": dict(temperature=0.7),
    "sampled-top-2": dict(temperature=1.0, top_p=0.9, top_k=50, logprobs=True, top_logprobs=2),
    "min-p-seeded": dict(temperature=0.8, min_p=0.05, seed=7),
    "penalties": dict(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
    "logit-bias": dict(logit_bias=((0, 5.0),)),
    "n-2": dict(temperature=0.8, n=2),
}
OUTPUT_TOKENS = 4


def warm_up(engine: LLMEngine, full: bool | None = None) -> float | None:
    """Run the warm-up requests to the end, wave by wave, and forget them; the seconds it took (None where none run:
    `full` defaults to whether the engine runs on a GPU). A failure is logged, its requests aborted, and the engine
    serves cold."""
    if not (engine.runner.device.type == "cuda" if full is None else full):
        return None
    start = time.monotonic()
    count = 0
    try:
        for wave in _waves(engine):
            count += _run_wave(engine, wave)
    except Exception as exc:  # a warm-up must not keep a worker from serving; the same fault would show in requests
        log.warning("warm-up failed (%s: %s); serving without it", type(exc).__name__, exc)
    forget_requests(engine)
    seconds = time.monotonic() - start
    log.info("warm-up: %d requests in %.1f s", count, seconds)
    return seconds


def forget_requests(engine: LLMEngine) -> None:
    """Leave the engine as a start found it after requests of its own: any still held aborted and stepped out,
    nothing in the prefix cache (no worker reports or serves a block of theirs), no preemption counted."""
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.reset_prefix_cache()
    engine.num_preemptions = 0


def _run_wave(engine: LLMEngine, wave: list[tuple[str, list[int], SamplingParams]]) -> int:
    """Add the wave's requests and step until they are done; how many were added."""
    added = 0
    for request_id, prompt, sampling in wave:
        try:
            engine.add_request(request_id, prompt, sampling)
            added += 1
        except FailedPrecondition as exc:  # structured output without a tokenizer: nothing to warm
            log.info("warm-up request %s not run: %s", request_id, exc)
        except Exception as exc:  # (a grammar compile past its time limit, say): the others still run
            log.warning("warm-up request %s not run (%s: %s)", request_id, type(exc).__name__, exc)
    while engine.has_unfinished_requests():
        engine.step()
    return added


def _waves(engine: LLMEngine):
    """Lists of (id, prompt, sampling), each run to its end before the next: each prompt size alone (up to a step's
    budget, and one token shorter), greedy; each way of sampling alone (CUDA loads a kernel at its first launch, and
    torch picks kernels by shape: a greedy row with one top logprob is not a sampled row with two), then all of them
    in one batch with more sampled rows, the sampler's batched paths; and one request under a grammar (JSON mode) on
    the backend --structured-output-backend puts first."""
    cap = min(engine.config.max_num_batched_tokens, engine.max_model_len - OUTPUT_TOKENS - 1,
              engine.block_manager.num_blocks * engine.config.block_size // 4)
    greedy = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    sizes = {n for n in PROMPT_TOKENS if n < cap} | {cap}  # the step budget's own size too
    for n in sorted(sizes | {n - ODD_BY for n in sizes if n > ODD_BY}):
        yield [(f"warm-up-prompt-{n}", _prompt(engine, n, 0), greedy)]
    ways = {name: dataclasses.replace(greedy, **changes) for name, changes in SAMPLING_WAYS.items()}
    for i, (name, sampling) in enumerate(ways.items()):
        yield [(f"warm-up-{name}", _prompt(engine, 8, i + 1), sampling)]
    rows = min(DECODE_BATCH, engine.config.max_num_seqs)
    batch = [*ways.values(), *[ways["sampled-top-2"]] * max(rows - len(ways), 0)][:rows]
    yield [(f"warm-up-batch-{i}", _prompt(engine, 8, 50 + i), sampling) for i, sampling in enumerate(batch)]
    # (a model without tokenizer files refuses it: FailedPrecondition, which _run_wave passes over)
    yield [("warm-up-grammar", _prompt(engine, 8, 99), dataclasses.replace(
        greedy, ignore_eos=False, structured=StructuredOutput(JSON_OBJECT)))]


def _prompt(engine: LLMEngine, n: int, seed: int) -> list[int]:
    """n ordinary token ids (none special to the model: no image placeholder, no end of text)."""
    skip = {engine.image_token_id, *engine.eos_token_ids}
    vocab = engine.vocab_size
    ids = [(100 + 7919 * (i + 31 * seed)) % max(vocab - 100, 1) + min(100, vocab - 1) for i in range(n)]
    return [t if t not in skip else min(100, vocab - 1) for t in ids]

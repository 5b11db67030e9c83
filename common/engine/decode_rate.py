"""How many output tokens a second the engine decodes with its batch full: measured once at start, after the warm-up
(on a GPU; the CPU runs neither), so that `disagg up` can size what sits in front of the workers (how many routers
relay their tokens, services/cli/derive.py) from this engine on this device rather than from a figure in the docs.

Full batch: min(--max-num-seqs, what the KV pool holds) rows of short prompts, greedy, timed over steps in which every
row decodes. It leaves the engine as the warm-up does: no request, nothing in the prefix cache."""
from __future__ import annotations

import logging
import time

from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from common.engine.warm_up import forget_requests

log = logging.getLogger(__name__)

PROMPT_TOKENS = 8
TIMED_STEPS = 8  # decode steps timed (after the first one of every row, which is part of its prefill)


def measure_decode_rate(engine: LLMEngine) -> float | None:
    """Output tokens a second at a full batch (None if it could not be measured: logged, the engine unharmed)."""
    block_size = engine.config.block_size
    per_row = -(-(PROMPT_TOKENS + TIMED_STEPS + 2) // block_size)
    rows = min(engine.config.max_num_seqs, engine.block_manager.num_blocks // per_row)
    if rows < 1:
        return None
    sampling = SamplingParams(temperature=0, max_tokens=TIMED_STEPS + 2, ignore_eos=True)
    vocab = engine.vocab_size
    skip = {engine.image_token_id, *engine.eos_token_ids}
    try:
        for row in range(rows):
            prompt = [(101 + 13 * row + 7 * i) % max(vocab - 100, 1) + min(100, vocab - 1)
                      for i in range(PROMPT_TOKENS)]
            engine.add_request(f"decode-rate-{row}", [t if t not in skip else min(100, vocab - 1) for t in prompt],
                               sampling)
        started: set[str] = set()
        while engine.has_unfinished_requests() and len(started) < rows:
            started.update(out.request_id for out in engine.step() if out.new_token_ids)  # every row prefilled
        made = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests() and made < rows * TIMED_STEPS:
            made += sum(len(out.new_token_ids) for out in engine.step())
        seconds = time.perf_counter() - start
    except Exception as exc:  # a measurement must not keep a worker from serving
        log.warning("decode rate not measured (%s: %s)", type(exc).__name__, exc)
        made, seconds = 0, 0.0
    forget_requests(engine)
    if made <= 0 or seconds <= 0:
        return None
    rate = made / seconds
    log.info("decode rate: %.0f output tokens/s at %d rows", rate, rows)
    return rate


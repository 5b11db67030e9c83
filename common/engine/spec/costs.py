"""What a verify step costs against a plain decode step, on this engine and device: measured at start, so that each
request's K (acceptance.py) weighs what speculation gains against what it costs here rather than a guess.

For each batch size in BATCHES (up to --max-num-seqs): that many rows decode, and the step is timed with every row
carrying k drafts, k = 0 .. K (dummy drafts: the timing does not depend on their acceptance). step_cost[k] is the
median k-draft step over the median plain one. Where a row of K + 1 tokens costs as much as K + 1 rows (a
compute-bound step: the CPU's, a GPU's at a large batch), no K pays and the policy turns speculation off there.
The engine is left as the warm-up leaves it: no request, nothing in the prefix cache.
"""
from __future__ import annotations

import logging
import statistics
import time

from common.engine.request import SamplingParams
from common.engine.spec.acceptance import AcceptancePolicy
from common.engine.warm_up import forget_requests

log = logging.getLogger(__name__)

BATCHES = (1, 8, 32)
PROMPT_TOKENS = 8
REPEATS = 5  # timed steps for each k, after one untimed


def measure_policies(engine) -> dict[int, AcceptancePolicy] | None:
    """Batch size -> the AcceptancePolicy of its measured step costs (None: not measured; logged)."""
    speculator = engine.speculator
    k_max = speculator.config.num_speculative_tokens
    batches = sorted({min(b, engine.config.max_num_seqs) for b in BATCHES})
    policies = {}
    try:
        for batch in batches:
            costs = _step_costs(engine, batch, k_max)
            if costs is None:
                break
            policies[batch] = AcceptancePolicy(step_cost=costs)
            log.info("speculative decoding: a step of %d rows with 0..%d drafts each costs %s of a plain one",
                     batch, k_max, " ".join(f"{c:.2f}" for c in costs))
    except Exception as exc:  # a measurement must not keep a worker from serving
        log.warning("speculative step costs not measured (%s: %s)", type(exc).__name__, exc)
    finally:
        speculator.forced_k = None
        forget_requests(engine)
        speculator.metrics.totals.clear()  # (its steps are no request's)
    return policies or None


def _step_costs(engine, batch: int, k_max: int) -> tuple[float, ...] | None:
    speculator = engine.speculator
    steps = (k_max + 1) * (REPEATS + 1) + 2
    block_size = engine.config.block_size
    if batch * -(-(PROMPT_TOKENS + steps * (k_max + 1)) // block_size) > engine.block_manager.num_blocks:
        return None  # the pool cannot hold the rows: no figure rather than a preempting one
    sampling = SamplingParams(temperature=0, max_tokens=steps * (k_max + 1), ignore_eos=True)
    vocab = engine.vocab_size
    for row in range(batch):
        prompt = [(101 + 13 * row + 7 * i) % max(vocab - 100, 1) + min(100, vocab - 1) for i in range(PROMPT_TOKENS)]
        engine.add_request(f"spec-cost-{batch}-{row}", prompt, sampling)
    speculator.forced_k = 0
    while engine.num_waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in engine.scheduler.running):
        engine.step()  # every row prefilled and decoding
    medians = []
    for k in range(k_max + 1):
        speculator.forced_k = k
        times = []
        for i in range(REPEATS + 1):
            start = time.perf_counter()
            engine.step()  # (on a device too it returns once its tokens are on the host)
            if i:
                times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    forget_requests(engine)
    costs, most = [], 1.0
    for m in medians:  # a step of more tokens costs no less than one of fewer: what the noise says otherwise is noise
        most = max(most, m / medians[0])
        costs.append(most)
    return tuple(costs)

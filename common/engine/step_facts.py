"""What one engine step ran, for the worker's step metrics (common.telemetry.metrics.observe_engine_step)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepFacts:
    kind: str  # "decode": every row one token; "prefill": prompt chunks alone; "mixed": chunks beside decode rows
    sequences: int  # rows in the step
    launched_ahead: bool  # it was launched before the step before it was read (async scheduling kept its pipeline)
    tokens: int = 0  # new tokens over its rows (a prefill step's: the prompt tokens it computed)


def step_facts(scheduled: list[tuple[object, int]], launched_ahead: bool) -> StepFacts:
    """`scheduled`: a StepLaunch's (request, new tokens) rows. A row of one token counts as a decode row (a prompt's
    last chunk of one token too: rare, and as cheap as one)."""
    chunks = sum(1 for _, n in scheduled if n > 1)
    kind = "decode" if not chunks else "prefill" if chunks == len(scheduled) else "mixed"
    return StepFacts(kind, len(scheduled), launched_ahead, sum(n for _, n in scheduled))

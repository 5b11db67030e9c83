"""What `disagg up` chooses from what its processes measured of themselves at start, where no flag says otherwise:
how many routers relay the decode workers' tokens. Each worker's ready line says how many tokens a second it
decodes with its batch full (common/engine/decode_rate.py, after the GPU warm-up), the first router's how much of
its CPU a relayed token took (services/router/warm_up.py); the routers needed are those that keep each one's loop
under ROUTER_BUSY of a core with every decode worker at full batch. They share one port (SO_REUSEPORT), so any
client with several connections spreads over them."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

# A router is added only where one core could not relay the workers' full-batch rate: each router holds a decode
# stream to every decode worker, which then writes one more message every step, and a loop with room to spare
# gains nothing from another (docs/benchmarks/vllm_gpu.md: on one GPU, 14 routers sized at half a core each served
# 0.83x one router's output at concurrency 64, and 3 routers 0.98x).
ROUTER_BUSY = 1.0

_DECODE_RATE = re.compile(r"decodes (\d+) tokens/s at a full batch")
_RELAY_COST = re.compile(r"(\d+) us of CPU a relayed token")


def decode_rate(note: str) -> float | None:
    """The decode rate a worker's ready line states (None: it measured none, as on the CPU)."""
    match = _DECODE_RATE.search(note)
    return float(match.group(1)) if match else None


def relay_cost_s(note: str) -> float | None:
    """The CPU seconds a relayed token a router's serving line states (None: not measured)."""
    match = _RELAY_COST.search(note)
    return int(match.group(1)) / 1e6 if match else None


@dataclass(frozen=True)
class RouterCount:
    routers: int
    why: str  # one line for the summary


def router_count(decode_notes: list[str], router_note: str, spare_cores: int) -> RouterCount:
    """Routers for decode workers whose ready lines are `decode_notes`, by the first router's `router_note`; at most
    `spare_cores` (the cores the workers' engine threads leave), at least one."""
    rates = [decode_rate(note) for note in decode_notes]
    cost = relay_cost_s(router_note)
    if not rates or any(rate is None for rate in rates) or cost is None:
        missing = ("the decode workers measured no rate" if not rates or any(rate is None for rate in rates)
                   else "the router measured no CPU a token")
        return RouterCount(1, f"1 router: {missing} (no warm-up: on the CPU one router outpaces the workers)")
    tokens = sum(rates)
    cores = tokens * cost
    wanted = max(1, math.ceil(cores / ROUTER_BUSY))
    routers = max(1, min(wanted, spare_cores))
    capped = f", capped at the {spare_cores} cores the workers leave" if routers < wanted else ""
    return RouterCount(routers, f"{routers} router{'s' if routers > 1 else ''} on one port: the decode workers decode "
                                f"{tokens:,.0f} tokens/s at a full batch and a router spends {cost * 1e6:.0f} us of CPU "
                                f"a token, {cores:.2f} cores in all, at most {ROUTER_BUSY:g} a router"
                                f"{capped} (--routers N to choose)")

"""Request path, from the front door on: when a request must be over, the budget every worker call of the request
gets as its gRPC deadline."""
from __future__ import annotations

import asyncio


class Deadline:
    """When a request must be over, on the event loop's clock; `remaining_s` is what worker calls get."""

    def __init__(self, at: float | None, budget_ms: int):
        self.at = at
        self.budget_ms = budget_ms

    @classmethod
    def of(cls, timeout_ms: int, rpc_time_remaining_s: float | None) -> "Deadline":
        budgets = [s for s in (timeout_ms / 1000 if timeout_ms else None, rpc_time_remaining_s) if s is not None]
        if not budgets:
            return cls(None, 0)
        budget = min(budgets)
        return cls(asyncio.get_running_loop().time() + budget, round(budget * 1000))

    def remaining_s(self) -> float | None:
        """Seconds left (at least a millisecond, so an expired deadline still fails the call), None without one."""
        if self.at is None:
            return None
        return max(self.at - asyncio.get_running_loop().time(), 0.001)

"""round_robin: the workers in turn, by endpoint."""
from __future__ import annotations

import itertools
from typing import ClassVar

from common.discovery import Role
from services.router.policies import Policy, PolicyContext
from services.router.workers import WorkerClient


class RoundRobin:
    needs_kv_index: ClassVar[bool] = False

    def __init__(self) -> None:
        self._counter = itertools.count()

    @classmethod
    def for_role(cls, role: Role, context: PolicyContext) -> Policy:
        return cls()

    async def pick(self, workers: list[WorkerClient], prompt: list[int] | None = None) -> WorkerClient:
        ordered = sorted(workers, key=lambda w: w.endpoint)
        return ordered[next(self._counter) % len(ordered)]

    def cached_tokens(self, worker: WorkerClient, prompt: list[int]) -> int | None:
        return None

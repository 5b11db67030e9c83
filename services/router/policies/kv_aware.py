"""kv_aware: prefill workers by cached prefix against queued prefill, from their KV events (a block in a tier below a
worker's device counts less than one on it: KvIndex.overlap_blocks); other roles by load."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.discovery import Role
from common.kv.block_hash import hash_blocks
from services.router.kv_index import KvIndex
from services.router.policies import Policy, PolicyContext
from services.router.policies.least_loaded import LeastLoaded
from services.router.workers import WorkerClient


@dataclass(frozen=True)
class KvAwareWeights:
    overlap: float = 1.0
    """Cost of one prompt block the worker must compute (Dynamo's prefill_load_scale)."""
    load: float = 1.0
    """Cost of one block of prefill already queued on the worker by this router."""


class KvAware:
    """Prefill worker with the lowest cost = overlap·max(new_blocks − cached_blocks, 0) + load·queued_blocks.

    cached_blocks comes from the worker's KV events (KvIndex); queued_blocks is the prefill work this
    router has in flight there, so a popular prefix cannot pile every request onto one worker.
    """

    needs_kv_index: ClassVar[bool] = True

    def __init__(self, index: KvIndex, weights: KvAwareWeights = KvAwareWeights()):
        self.index = index
        self.weights = weights

    @classmethod
    def for_role(cls, role: Role, context: PolicyContext) -> Policy:
        """Prefill by cache and load; decode and encode by load (and encode-less aggregated requests with them)."""
        if role is not Role.PREFILL:
            return LeastLoaded()
        index = context.kv_index if context.kv_index is not None else KvIndex()
        return cls(index, KvAwareWeights(context.kv_overlap_weight, context.kv_load_weight))

    def cached_tokens(self, worker: WorkerClient, prompt: list[int]) -> int:
        """The prompt tokens the worker's prefix cache holds, as far as its events tell (a lower tier's, weighted by
        its hit cost: the tokens it need not compute, in computed tokens' worth)."""
        return int(self._cached_blocks(worker, hash_blocks(prompt, worker.info.block_size)) * worker.info.block_size)

    def cost(self, worker: WorkerClient, prompt: list[int], hashes: list[int] | None = None) -> float:
        """`hashes`: the prompt's block hashes at the worker's block size, when the caller has them already."""
        block_size = worker.info.block_size
        if hashes is None:
            hashes = hash_blocks(prompt, block_size)
        new_blocks = max(-(-len(prompt) // block_size) - self._cached_blocks(worker, hashes), 0)
        queued_blocks = worker.pending_prefill_tokens / block_size
        return self.weights.overlap * new_blocks + self.weights.load * queued_blocks

    async def pick(self, workers: list[WorkerClient], prompt: list[int] | None = None) -> WorkerClient:
        if prompt is None:
            return min(workers, key=lambda w: (w.pending_prefill_tokens, w.endpoint))
        by_block_size: dict[int, list[int]] = {}  # the prompt hashed once per block size, not once per worker

        def cost(worker: WorkerClient) -> float:
            size = worker.info.block_size
            if size not in by_block_size:
                by_block_size[size] = hash_blocks(prompt, size)
            return self.cost(worker, prompt, by_block_size[size])

        return min(workers, key=lambda w: (cost(w), w.endpoint))

    def _cached_blocks(self, worker: WorkerClient, hashes: list[int]) -> float:
        return self.index.overlap_blocks(worker.endpoint, hashes)

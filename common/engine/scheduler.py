"""Continuous batching with chunked prefill and preemption by recompute.

Every request has `num_computed_tokens` of its `num_tokens` in the KV cache. Each step gives
running decodes their next token, then unfinished prefills their next chunk, within a token
budget, then admits waiting requests while the budget and the pool allow. One request's chunk
is at most `long_prefill_token_threshold` tokens (vLLM's name), so a long prompt leaves room in
every step for the decodes and a newly arrived prompt instead of taking the whole budget.
When a running request cannot get a block, the most recently admitted one is preempted:
its blocks are freed and it goes back to the queue to be recomputed. Admission leaves room for the
running requests' next `growth_reserve` tokens each (capped at what each may still generate), so
that preemption stays for growth past that horizon rather than for every newcomer that filled the
pool (TensorRT-LLM's GUARANTEED_NO_EVICT reserves a request's whole max_tokens; this is its horizon).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from common.engine.block_manager import BlockManager
from common.engine.request import Request, RequestStatus, RequestType
from common.kv.layout import PlacedKv


@dataclass
class ScheduledBatch:
    """What to run this step; the model runner decides how."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    kv_imports: list[Request] = field(default_factory=list)  # copy their imported KV in before running
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.requests

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int | None = None, growth_reserve: int = 0):
        self.block_manager = block_manager
        self.growth_reserve = growth_reserve
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold or max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.deferred = 0  # waiting requests the last admission passed over while a KV tier loads their blocks

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues (finished or aborted); the caller frees its blocks."""
        if request in self.running:
            self.running.remove(request)
            if not self.running:  # an idle engine steps no more: nothing grows, an import takes what is free
                self.block_manager.growth_reserved = 0
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self, preempt: bool = True, reserved: int = 0) -> ScheduledBatch:
        """The next step. Without `preempt` (a step launched while another still runs) a row that gets no blocks
        ends the batch instead of freeing someone's: the next step scheduled with the GPU idle preempts.
        `reserved`: tokens of the step the caller fills itself (a mixed step launched ahead: its decode rows)."""
        batch = ScheduledBatch()
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:  # decodes first: a prefill chunk never delays a running stream
            budget = self.max_num_batched_tokens - reserved - batch.num_tokens
            if budget <= 0:
                break
            if request in batch.preempted:
                continue  # preempted by an earlier row of this step
            n = min(request.num_tokens - request.num_computed_tokens, self.long_prefill_token_threshold, budget)
            if request.draft_token_ids:
                n = self._with_drafts(request, budget)
            if preempt and not self._allocate_or_preempt(request, n, batch):
                break  # the request itself was preempted: every row after it in `running` already was
            if not preempt and not self.block_manager.allocate_slots(request, n):
                return batch  # short of blocks: no newcomer takes what a running row waits for
            batch.requests.append(request)
            batch.num_new_tokens.append(n)
        if not batch.preempted:
            self._admit_waiting(batch, self.max_num_batched_tokens - reserved - batch.num_tokens)
        return batch

    def admit_waiting(self, budget: int, only: Callable[[Request], bool]) -> ScheduledBatch:
        """Admit waiting requests from the head of the queue while `only` takes them (the queue's order kept),
        within `budget` tokens, outside a schedule(): the engine joins decodes to a step launched ahead."""
        batch = ScheduledBatch()
        self._admit_waiting(batch, budget, only)
        return batch

    def _with_drafts(self, request: Request, budget: int) -> int:
        """A decode row's tokens with its drafts (speculative decoding): as many as the budget and the free blocks
        take; drafts never preempt anyone (a row short of blocks runs plain, and only its own token may preempt)."""
        n = min(1 + len(request.draft_token_ids), budget)
        if n > 1 and not self.block_manager.allocate_slots(request, n):
            n = 1
        request.draft_token_ids = request.draft_token_ids[: n - 1]
        return n

    def _allocate_or_preempt(self, request: Request, n: int, batch: ScheduledBatch) -> bool:
        """Blocks for `n` more tokens of `request`, preempting from the end of `running` until they fit."""
        while not self.block_manager.allocate_slots(request, n):
            victim = self.running.pop()
            if victim in batch.requests:  # a decode scheduled before this prefill chunk leaves the batch
                i = batch.requests.index(victim)
                del batch.requests[i], batch.num_new_tokens[i]
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is request:
                return False
        return True

    def growth_blocks(self, request: Request) -> int:
        """Blocks `request` lacks to hold its tokens and `growth_reserve` more (at most its max_total_tokens; a
        context_only prompt grows no further: its first token's KV is the decode worker's). Attribute reads and
        integer arithmetic only: publish_growth sums it over every running row once a step."""
        tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        if request.request_type is not RequestType.CONTEXT_ONLY:
            tokens += self.growth_reserve
        target = min(request.max_total_tokens, tokens)
        return max(-(-target // self.block_manager.block_size) - len(request.block_table), 0)

    def publish_growth(self) -> int:
        """The running requests' growth_blocks, summed, where admission and the KV data plane's reservations read it
        (BlockManager.growth_reserved): a newcomer or an import waits rather than take them. The engine publishes it
        once a step, before it schedules; within the step it stays true or errs high (a row allocated a block needs
        one less; a preempted row frees more than it held back)."""
        held = sum(map(self.growth_blocks, self.running)) if self.growth_reserve else 0
        self.block_manager.growth_reserved = held
        return held

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, only: Callable[[Request], bool] | None = None) -> int:
        """Admit from the head of the queue. A request whose blocks a KV tier still loads (BlockManager.onboard_ready)
        is passed over, keeping its place, so that no step waits for the disk; those behind it go on in order."""
        deferred: list[Request] = []
        try:
            return self._admit_in_order(batch, budget, only, deferred)
        finally:
            self.waiting.extendleft(reversed(deferred))
            self.deferred = len(deferred)

    def _admit_in_order(self, batch: ScheduledBatch, budget: int, only: Callable[[Request], bool] | None,
                        deferred: list[Request]) -> int:
        held = self.block_manager.growth_reserved  # (publish_growth, at the step's start)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not self.block_manager.onboard_ready(request):
                deferred.append(self.waiting.popleft())
                continue
            if only is not None and not only(request):
                break
            if held and self.growth_blocks(request) > self.block_manager.num_free_blocks - held:
                break  # it waits for room (FCFS): its blocks would be those the running rows grow into
            fresh = request.kv_import is None and not request.block_table  # holds no blocks yet
            if request.kv_import is not None:
                if not self.block_manager.allocate_slots(request, request.num_prompt_tokens):
                    break
                request.num_computed_tokens = request.num_prompt_tokens
                batch.kv_imports.append(request)
            else:
                self.block_manager.match_prefix(request)
                if request.num_preemptions == 0:
                    request.num_cached_tokens = request.num_computed_tokens
            n = min(request.num_tokens - request.num_computed_tokens, self.long_prefill_token_threshold, budget)
            whole = min(request.num_tokens - request.num_computed_tokens, self.long_prefill_token_threshold)
            if fresh and n == budget < whole and any(k > 1 for k in batch.num_new_tokens):
                # Only the step's leftover budget would start it, beside another prompt's chunk: that slows the
                # step (and the other prompt's first token) for a sliver of this prompt, which then needs a second
                # step anyway. It starts next step, in one piece where it fits (FCFS either way).
                self.block_manager.free(request)  # give back the prefix hits; matched again next step
                break
            if not self.block_manager.allocate_slots(request, n):
                if request.kv_import is None:
                    self.block_manager.free(request)  # give back the prefix hits; retry next step
                else:
                    batch.kv_imports.pop()
                    if isinstance(request.kv_import, PlacedKv):
                        request.num_computed_tokens = 0  # its blocks hold the imported KV: kept for the next try
                    else:
                        self.block_manager.free(request)
                break
            self.waiting.popleft()
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append(request)
            batch.num_new_tokens.append(n)
            budget -= n
            if self.growth_reserve:
                held += self.growth_blocks(request)
                self.block_manager.growth_reserved = held
        return budget

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.draft_token_ids = []
        request.status = RequestStatus.WAITING
        request.kv_import = None  # recompute from tokens: an imported KV is gone with its blocks
        request.num_preemptions += 1
        self.waiting.appendleft(request)

"""Request path, before prefill: per request, prefill on a prefill worker (remote) or on the decode worker itself
(local).

Dynamo's disaggregated router rule, extended with the decode worker's load: a prompt goes remote when
the tokens the decode worker would have to compute (its uncached part) exceed --max-local-prefill-tokens
and the prefill worker's queue is under --max-prefill-queue-tokens. A saturated prefill queue sends the
request to the decode worker only while that worker has room (no prompt to compute in its engine, a free
batch slot); when both sides are busy it queues on the prefill worker, whose job that work is.
--min-remote-prefill-tokens stays a hard floor: shorter prompts always run locally.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from opentelemetry import trace

from common.pb.disagg.v1 import worker_pb2
from common.telemetry.metrics import Metrics
from services.router.policies import Policy
from services.router.policies.least_loaded import fetch_load
from services.router.workers import WorkerClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DisaggConfig:
    min_remote_prefill_tokens: int = 0
    """Prompts shorter than this never go to a prefill worker."""
    max_local_prefill_tokens: int = 0
    """Uncached prompt tokens up to this many are computed by the decode worker itself."""
    max_prefill_queue_tokens: int = 0
    """At or above this many queued prefill tokens a prefill worker counts as saturated; 0: no limit."""


@dataclass(frozen=True)
class Demand:
    """What the request would cost on each side."""

    prompt_tokens: int
    uncached_on_decode: int
    """Prompt tokens the decode worker's prefix cache does not hold (the prompt length without kv_aware)."""
    uncached_on_prefill: int
    """The same for the prefill worker the policy picked."""


@dataclass(frozen=True)
class PrefillQueue:
    """The picked prefill worker's queue: what this router has sent there, and what the worker reports."""

    router_tokens: int
    """Uncached prompt tokens this router has in flight on the worker."""
    router_requests: int
    """Requests this router has in flight on the worker."""
    waiting_requests: int | None = None
    """Requests waiting in the worker's engine (GetLoad); None when it did not answer."""

    def queued_tokens(self, incoming_tokens: int) -> int:
        """This router's tokens, plus waiting requests it did not send (other routers'), each taken to be
        about the size of the incoming one: the worker reports requests, not tokens."""
        others = max((self.waiting_requests or 0) - self.router_requests, 0)
        return self.router_tokens + others * incoming_tokens


@dataclass(frozen=True)
class DecodeLoad:
    running_requests: int
    waiting_requests: int
    max_num_seqs: int
    """Its batch size limit (WorkerInfo.limits); 0: it reports none."""
    prefilling_tokens: int = 0
    """Prompt tokens this router sent it to prefill itself that have not given their first token yet."""
    prompt_tokens_to_compute: int | None = None
    """Prompt tokens its engine still has to compute, from any router (Load.prompt_tokens_to_compute); None: it
    does not report them."""

    @property
    def has_room(self) -> bool:
        """No prompt to compute in its engine, a free batch slot and no prompt of ours prefilling there: a local
        prefill starts at once and has the worker's step budget beside its decode rows to itself. One at a time:
        local prefills admitted while others still run pile up in chunks beside the decodes, and their TTFT grows
        with the pile. Handoffs waiting to join its next step do not count: they bring their KV, and under load one
        arrives every few ms, so counting them would refuse nearly every prompt that overflows the prefill queue.
        A worker that does not report its prompt tokens has room only with nothing waiting."""
        idle = (self.prompt_tokens_to_compute == 0 if self.prompt_tokens_to_compute is not None
                else self.waiting_requests == 0)
        return (idle and self.prefilling_tokens == 0
                and (self.max_num_seqs == 0 or self.running_requests < self.max_num_seqs))


LOCAL_REASONS = ("below_min_prompt", "no_prefill_worker", "short_uncached", "prefill_queue_full")
REMOTE_REASONS = ("long_uncached", "decode_busy")


def static_decision(config: DisaggConfig, demand: Demand, has_prefill_worker: bool) -> tuple[bool, str] | None:
    """The decision when the workers' load cannot change it; None when it depends on the queues."""
    if demand.prompt_tokens < config.min_remote_prefill_tokens:
        return False, "below_min_prompt"
    if not has_prefill_worker:
        return False, "no_prefill_worker"
    if demand.uncached_on_decode <= config.max_local_prefill_tokens:
        return False, "short_uncached"
    if config.max_prefill_queue_tokens == 0:
        return True, "long_uncached"
    return None


def decide(config: DisaggConfig, demand: Demand, prefill: PrefillQueue | None,
           decode: DecodeLoad | None) -> tuple[bool, str]:
    """(remote, reason). `prefill` None: no prefill worker; `decode` None: its load is unknown (no room)."""
    known = static_decision(config, demand, prefill is not None)
    if known is not None:
        return known
    if prefill.queued_tokens(demand.uncached_on_prefill) < config.max_prefill_queue_tokens:
        return True, "long_uncached"
    if decode is not None and decode.has_room:
        return False, "prefill_queue_full"
    return True, "decode_busy"


class PrefillPlacement:
    """Gathers a request's numbers from the router's workers and applies `decide`.

    GetLoad is asked only when the queues can change the answer. The caller must start the remote
    prefill without awaiting anything in between, so the tokens it queues (WorkerClient.prefilling)
    are counted before the next request is placed.
    """

    def __init__(self, config: DisaggConfig, policy: Policy | None = None, metrics: Metrics | None = None):
        self.config = config
        self._policy = policy
        self._metrics = metrics

    async def place(self, prompt: list[int], decode: WorkerClient,
                    pick_prefill: Callable[[], Awaitable[WorkerClient | None]]) -> WorkerClient | None:
        """The prefill worker to run the prompt on, or None to prefill on the decode worker."""
        prefill = await pick_prefill() if len(prompt) >= self.config.min_remote_prefill_tokens else None
        demand = Demand(len(prompt), self._uncached(decode, prompt),
                        self._uncached(prefill, prompt) if prefill is not None else len(prompt))
        decision = static_decision(self.config, demand, prefill is not None)
        if decision is None:
            prefill_load, decode_load = await asyncio.gather(fetch_load(prefill), fetch_load(decode))
            queue = PrefillQueue(prefill.pending_prefill_tokens, prefill.inflight,
                                 prefill_load.waiting_requests if prefill_load is not None else None)
            decision = decide(self.config, demand, queue, _decode_load(decode, decode_load))
        remote, reason = decision
        self._record(remote, reason, demand)
        return prefill if remote else None

    def _uncached(self, worker: WorkerClient, prompt: list[int]) -> int:
        """Prompt tokens the worker would compute: beyond what the policy predicts it caches (kv_aware)."""
        cached = self._policy.cached_tokens(worker, prompt) if self._policy is not None else None
        if cached is None:
            return len(prompt)
        # at least one: a fully cached prompt still computes its last token to sample the first output
        return max(len(prompt) - cached, 1)

    def _record(self, remote: bool, reason: str, demand: Demand) -> None:
        where = "remote" if remote else "local"
        trace.get_current_span().set_attribute("disagg.prefill", f"{where}:{reason}")
        log.debug("prefill %s (%s): %d prompt tokens, %d uncached on decode", where, reason, demand.prompt_tokens,
                  demand.uncached_on_decode)
        if self._metrics is not None:
            self._metrics.get("disagg_routing_prefill_decisions_total", where=where, reason=reason).inc()


def _decode_load(worker: WorkerClient, load: worker_pb2.Load | None) -> DecodeLoad | None:
    if load is None:
        return None
    return DecodeLoad(load.running_requests, load.waiting_requests, worker.info.limits.max_num_seqs,
                      worker.pending_prefill_tokens,
                      load.prompt_tokens_to_compute if load.HasField("prompt_tokens_to_compute") else None)

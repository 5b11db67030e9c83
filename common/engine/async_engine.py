"""The asyncio bridge: the engine loop runs in its own thread; coroutines submit, stream and abort.

Every touch of the engine happens on its thread (commands go through a queue), so the gRPC
event loop never blocks on a model step. A KV session's lookup, lease and release alone run on the caller's
thread, under the session table's and the block manager's locks (held for microseconds), so that a pull or a
Release never waits for a step; so does a load report, which only reads counts.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence, TypeVar

import torch

from common.engine.config import EngineConfig
from common.devices import bind_thread
from common.engine.engine import LLMEngine
from common.engine.interface import EngineFacts, EngineLoad, EngineRequest, KvBlocks
from common.engine.request import FinishReason, RequestOutput
from common.engine.spec.metrics import SpecMetrics
from common.engine.step_facts import StepFacts
from common.kv.tiers.hit_cost import HitCostReporter
from common.kv.events import Subscriber
from common.kv.session import KvSession

log = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_WAKEUP_S = 0.25  # how often an idle loop wakes to expire KV sessions


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    members: int = 1  # choices (n > 1: each ends with a finished output of its own)
    running: int = 1  # of them, those not finished yet (the engine thread's count)

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.Queue[tuple[Callable, concurrent.futures.Future]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._adding = 0  # requests on their way to the engine thread (their add command not run yet)
        self._adding_prompt_tokens = 0  # their prompt tokens to compute (none for a handoff with its KV)
        self._stopped = threading.Event()
        # Called on the event loop with how long a step's outputs waited for it (the worker's metric), if set.
        self.output_wait: Callable[[float], None] | None = None
        # Called on the engine thread after each step that ran something, if set (the worker's step metrics): what
        # it ran, its wall and engine-thread CPU seconds, and the period it closed: (the step before, the seconds
        # from that one's start to this one's) where the engine stayed busy between them (None after an idle wait).
        self.step_done: Callable[[StepFacts, float, float, tuple[StepFacts, float] | None], None] | None = None
        self.warm_up_s: float | None = None  # how long from_config's warm-up took (None: none ran)
        self.decode_tokens_per_s: float | None = None  # measured after the warm-up (decode_rate.py; None: not)
        # KV tiers: what a hit in each costs against computing it, told to the router as a KV event.
        self._hit_costs = (HitCostReporter(engine.kv_tiers.names, engine.kv_events, engine.kv_tiers.payoff)
                           if engine.kv_tiers is not None and engine.kv_events is not None else None)
        if engine.kv_tiers is not None:  # a prefetch that ends wakes a loop waiting for it (_waits_for_tiers)
            engine.kv_tiers.on_loaded = lambda: self._commands.put((lambda e: None, concurrent.futures.Future()))
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLMEngine":
        """Load the engine, warm it up (common.engine.warm_up) and, warm, measure its decode rate
        (common.engine.decode_rate) and what speculation costs (common.engine.spec.costs) before its loop starts."""
        from common.engine.decode_rate import measure_decode_rate
        from common.engine.warm_up import warm_up

        engine = LLMEngine(config)
        seconds = warm_up(engine)
        rate = measure_decode_rate(engine) if seconds is not None else None
        if engine.speculator is not None:  # (after the warm-up: its kernels built, a step is timed as it will run)
            from common.engine.spec.costs import measure_policies

            policies = measure_policies(engine)
            if policies is not None:
                engine.speculator.set_policies(policies)
        started = cls(engine)
        started.warm_up_s, started.decode_tokens_per_s = seconds, rate
        return started

    @property
    def spec_metrics(self) -> SpecMetrics | None:
        """Speculative decoding's counts (None: it is off), for the worker to bind to its Prometheus metrics."""
        speculator = self.engine.speculator
        return None if speculator is None else speculator.metrics

    @property
    def grammar_compiles(self) -> Callable[[str, str, float], None] | None:
        """Called with (backend, outcome, seconds) after each grammar compile (the worker's metrics), if set."""
        return self.engine.grammars.observe

    @grammar_compiles.setter
    def grammar_compiles(self, observer: Callable[[str, str, float], None] | None) -> None:
        self.engine.grammars.observe = observer

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result (or raise its error)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Errors in the request raise before the first output;
        leaving the loop early (or being cancelled) aborts the request and frees its blocks."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        request_id = request.request_id
        grammar = None
        if request.sampling.structured is not None:  # compiled off the engine thread: the batch steps meanwhile
            grammar = await self.engine.grammars.compile_async(request.sampling.structured)

        def add(engine: LLMEngine) -> None:
            added = engine.add_request(request_id, request.prompt_token_ids, request.sampling, request.request_type,
                                       request.kv_import, request.first_token, request.images,
                                       request.more_first_tokens, request.choices, grammar=grammar)
            stream.members = stream.running = 1 + len(added.forks)
            self._streams[request_id] = stream

        adding_tokens = 0 if request.kv_import is not None else len(request.prompt_token_ids)
        self._adding += 1
        self._adding_prompt_tokens += adding_tokens
        try:
            await self.call(add)
        finally:
            self._adding -= 1
            self._adding_prompt_tokens -= adding_tokens
        finished = False
        running = stream.members
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                running -= item.finished
                finished = running == 0
                yield item
        finally:
            if not finished:
                self._commands.put((lambda e: self._abort(e, request_id), concurrent.futures.Future()))

    async def abort(self, request_id: str) -> bool:
        """Cancel a request from anywhere; its stream ends with an ABORT output."""
        return await self.call(lambda e: self._abort(e, request_id))

    def _abort(self, engine: LLMEngine, request_id: str) -> bool:
        """Abort a request (every choice), or one choice of it by "<id>#<index>"; each ends with an ABORT output."""
        aborted = engine.abort_members(request_id)
        for request in aborted:
            stream = self._streams.get(request.output_id)
            if stream is None:
                continue
            stream.put(RequestOutput(request.output_id, [], [], finished=True, finish_reason=FinishReason.ABORT,
                                     num_prompt_tokens=request.num_prompt_tokens, index=request.index,
                                     num_output_tokens=len(request.output_token_ids)))
            self._ended(request.output_id, stream)
        return bool(aborted)

    def _ended(self, request_id: str, stream: _Stream) -> None:
        """One choice of the stream's request finished: the stream goes when the last one has."""
        stream.running -= 1
        if stream.running <= 0:
            self._streams.pop(request_id, None)

    # --- the engine interface (common.engine.interface.Engine) ---

    async def facts(self) -> EngineFacts:
        return await self.call(lambda e: EngineFacts(e.kv_layout, e.max_model_len, e.config, e.image_token_id,
                                                     e.kv_cache.device))

    async def load(self) -> EngineLoad:
        """Read here, not between steps: a router asks every worker before placing a request, and a prefill
        worker's step can take tens of ms. The counts are a step old at most; a request still on its way to the
        engine thread counts as waiting (and its prompt as to compute)."""
        load = self.engine.load_snapshot()
        return dataclasses.replace(load, waiting=load.waiting + self._adding,
                                   prompt_tokens_to_compute=load.prompt_tokens_to_compute + self._adding_prompt_tokens)

    async def abort_all(self) -> int:
        running = await self.call(lambda e: list(e.requests))
        aborted = await asyncio.gather(*(self.abort(request_id) for request_id in running))
        return sum(aborted)

    async def session(self, session_id: str) -> KvSession:
        return dataclasses.replace(self.engine.sessions.get(session_id))

    async def lease_session(self, session_id: str, block_ids: Sequence[int] = ()) -> list[int]:
        return self.engine.lease_session(session_id, list(block_ids))

    async def end_lease(self, session_id: str) -> None:
        self.engine.end_lease(session_id)

    async def release_session(self, session_id: str) -> bool:
        return self.engine.release_session_if_held(session_id)

    async def release_sessions_of(self, request_id: str) -> int:
        return await self.call(lambda e: e.release_sessions_of(request_id))

    async def release_all_sessions(self) -> int:
        return await self.call(lambda e: e.release_sessions_of(None))

    async def session_attributes(self, session_id: str) -> dict[str, str]:
        """None of its own: the KV data plane moves this engine's KV, and its exporter names the session's backends."""
        await self.call(lambda e: e.sessions.get(session_id))
        return {}

    async def kv_cache(self) -> torch.Tensor:
        return await self.call(lambda e: e.kv_cache)

    async def kv_blocks(self) -> KvBlocks:
        return await self.call(lambda e: e.kv_blocks())

    async def subscribe_kv_events(self, loop: asyncio.AbstractEventLoop) -> Subscriber | None:
        return await self.call(lambda e: e.kv_events.subscribe(loop) if e.kv_events else None)

    def unsubscribe_kv_events(self, subscriber: Subscriber) -> None:
        """Safe from any thread or a closing generator: queued for the engine thread, not awaited."""
        self._commands.put((lambda e: e.kv_events.unsubscribe(subscriber), concurrent.futures.Future()))

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put((lambda e: None, concurrent.futures.Future()))
        self._thread.join(timeout=10)
        self.engine.close()

    # --- the engine thread ---

    def _loop(self) -> None:
        engine = self.engine
        bind_thread(engine.config.device)  # a new thread starts on GPU 0
        previous: tuple[StepFacts, float] | None = None  # the last step and its start, while the engine stayed busy
        while not self._stopped.is_set():
            self._run_commands(block=not engine.has_unfinished_requests())
            if not engine.has_unfinished_requests():
                engine.expire_sessions()
                previous = None
                continue
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                outputs = engine.step()
            except Exception as exc:  # a broken step fails its requests, not the process
                log.exception("engine step failed; failing %d requests", len(self._streams))
                self._fail_all(exc)
                previous = None
                continue
            step, tiers = engine.last_step, engine.kv_tiers
            if step is not None and (self.step_done is not None or tiers is not None):
                wall = time.perf_counter() - started
                if tiers is not None and step.kind == "prefill":  # what a hit saves: whether one pays, its cost
                    tiers.payoff.prefill(step.tokens, wall)
                    if self._hit_costs is not None:
                        self._hit_costs.publish()
                if self.step_done is not None:
                    self.step_done(step, wall, time.thread_time() - cpu,
                                   None if previous is None else (previous[0], started - previous[1]))
            previous = None if step is None else (step, started)
            self._deliver(outputs)
            if step is None and self._waits_for_tiers(engine):
                # until a prefetch ends (its callback's command), a request comes or a held request's wait is over
                self._run_commands(block=True, timeout=engine.kv_tiers.wait_left_s())

    @staticmethod
    def _waits_for_tiers(engine: LLMEngine) -> bool:
        """Nothing runs and every waiting request waits for its blocks from a KV tier: a step would find nothing."""
        scheduler = engine.scheduler
        return not scheduler.running and 0 < scheduler.deferred == len(scheduler.waiting)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs reach each event loop in one call: one wake-up of its thread a step, not one a request
        (each call_soon_threadsafe writes to the loop's socket, and the woken loop takes the GIL from this thread)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, out))
                if out.finished:
                    self._ended(out.request_id, stream)
        handed = time.perf_counter()
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch, handed, self.output_wait)

    def _run_commands(self, block: bool, timeout: float | None = None) -> None:
        wait = _IDLE_WAKEUP_S if timeout is None else min(timeout, _IDLE_WAKEUP_S)
        try:
            item = self._commands.get(timeout=wait) if block and wait > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = item
            # A caller cancelled before its turn: skip the command. Once running, a future can
            # no longer be cancelled, so setting its result below cannot fail (and kill this thread).
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:
                    future.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_all(self, exc: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.put(exc)
        self._streams.clear()


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]], handed: float,
             waited: Callable[[float], None] | None) -> None:
    if waited is not None:
        waited(time.perf_counter() - handed)
    for stream_queue, out in batch:
        stream_queue.put_nowait(out)

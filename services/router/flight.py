"""Request path, throughout: one request in the router (its Flight), from its front door's call to its last event.

A Flight holds the request's state — the request, its deadline, the prepared (tokenised) request, the KV session
prefill exported, the embeddings encode stored, and what has been sent to the client (`sent`) — and is the event
stream its front door iterates (Core.stream's answer). The orchestrator's one loop drives it; worker events are
applied here, the only writer of `sent`. How a request ends early is written once here: `cancel()` (its stream
ends with Finished(CANCELLED)), `end(error)` (raised to its consumer), or closing the stream (counted CANCELLED).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

import grpc

from common.pb.disagg.v1 import common_pb2
from services.kit.serving import status_of
from services.router.deadline import Deadline
from services.router.decode_events import (CachedTokens, DecodeEvent, DecodeFinished, KvHandoff, Tokens,
                                           WorkerTimings)
from services.router.encode_prefill import ExportedSession, PrefillReady, Releaser, first_token_ends
from services.router.generation import Event, Finished, FinishReason, GenerationRequest
from services.router.prepare import PreparedRequest
from services.router.responses import ResponseBuilder


class _Cancelled(Exception):
    """How a flight ends on `cancel()`: with Finished(CANCELLED), not an error."""


class Flight:
    def __init__(self, request: GenerationRequest, sent: ResponseBuilder, deadline: Deadline,
                 loop: Callable[["Flight"], AsyncIterator[Event]]):
        self.request = request
        self.deadline = deadline
        self.sent = sent  # what the client has been sent: tokens, text, timings
        self.prepared: PreparedRequest | None = None
        self.session: ExportedSession | None = None  # the KV session prefill exported, until a decode worker takes it
        self.embeddings: list[common_pb2.EmbeddingRef] = []  # what encode stored, while the router must free it
        self._events = loop(self)
        self._task: asyncio.Task | None = None  # the consumer's, while it waits for an event
        self._with_consumer = False  # the consumer holds an event (it is not waiting inside the loop)
        self._ending: Exception | None = None
        self._cancelled_task = False
        self._over = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def cancel(self) -> None:
        """End the request now (its worker calls are cancelled, which frees their KV): the stream's next event is
        Finished(CANCELLED). No-op once the stream has ended."""
        self._end_with(_Cancelled())

    def end(self, error: Exception) -> None:
        """End the request with `error`, raised to its consumer (the drain's deadline passed)."""
        self._end_with(error)

    def failed(self, exc: BaseException) -> Finished:
        """Finished(ERROR) for an error this stream raised, with the usage so far (for a front door that reports
        errors as events)."""
        return self.sent.failed(exc)

    def __aiter__(self) -> "Flight":
        return self

    async def __anext__(self) -> Event:
        if self._over:
            raise StopAsyncIteration
        self._task, self._with_consumer = asyncio.current_task(), False
        try:
            if self._ending is not None:  # ended while its consumer held an event (or before the first)
                await self._events.aclose()
                return self._ended()
            event = await anext(self._events)
        except asyncio.CancelledError:
            if not self._cancelled_task or self._task.uncancel() > 0:  # cancelled from outside too: the client left
                self._over = True
                raise
            return self._ended()
        except StopAsyncIteration:
            self._over = True
            raise
        except Exception as exc:
            self._over = True
            self.sent.close(status_of(exc))
            raise
        self._with_consumer = True
        self._over = isinstance(event, Finished)  # the last event: nothing may end the request after it
        return event

    async def aclose(self) -> None:
        """The consumer is done (or left): the loop stops, what it holds is freed; a request left before its end
        counts as CANCELLED."""
        self._over = True
        await self._events.aclose()
        self.sent.close(grpc.StatusCode.CANCELLED)  # a no-op after an outcome

    def bind(self, prepared: PreparedRequest) -> None:
        self.prepared = prepared
        self.sent.bind(prepared)

    def prefilled(self, ready: PrefillReady, eos_token_ids: list[int]) -> list[Event]:
        """Prefill answered: its session is the flight's, its first token the client's first; the Finished too when
        that token already ends the request."""
        self.session = ready.session
        self.embeddings = []  # prefill pulled them and released them
        sent = self.sent
        sent.cached_prompt_tokens = ready.response.cached_tokens
        sent.prefilled(ready.response.ttft_breakdown)
        sent.prompt_scored(ready.response.prompt_logprobs)
        if self.prepared.params.n > 1:
            return self._prefilled_choices(ready, eos_token_ids)
        delta = sent.delta([ready.first_token], [ready.first_logprob()])
        events: list[Event] = [delta] if delta is not None else []
        ending = first_token_ends(self.prepared, sent.stopped, ready.first_token, eos_token_ids)
        if ending is not None:
            events += sent.finish(*ending)
        return events

    def _prefilled_choices(self, ready: PrefillReady, eos_token_ids: list[int]) -> list[Event]:
        """n > 1: each choice's first token; those it ends end here, the others go to decode (`first_tokens`)."""
        sent, events = self.sent, []
        for index, logprob in enumerate(ready.first_logprobs()):
            delta = sent.delta([logprob.token_id], [logprob], index)
            events += [delta] if delta is not None else []
            ending = first_token_ends(self.prepared, index not in sent.live_choices(), logprob.token_id,
                                      eos_token_ids)
            if ending is not None:
                events += sent.end_choice(index, *ending)
        if sent.stopped:
            events += sent.finish(FinishReason.STOP)
        return events

    def first_tokens(self, ready: PrefillReady) -> dict[int, int]:
        """n > 1: the first token of each choice still running, by index (for the decode worker)."""
        live = set(self.sent.live_choices())
        return {i: lp.token_id for i, lp in enumerate(ready.first_logprobs()) if i in live}

    def apply(self, event: DecodeEvent) -> list[Event]:
        """A decode worker's event, applied to what the client has been sent: the client's events it makes."""
        sent = self.sent
        match event:
            case Tokens(token_ids, logprobs, index, prompt_logprobs):
                if prompt_logprobs:
                    sent.prompt_scored(prompt_logprobs)
                delta = sent.delta(token_ids, logprobs, index)
                return [delta] if delta is not None else []
            case DecodeFinished(reason, stop_token_id, choices):
                return sent.finish(reason, stop_token_id, choices)
            case KvHandoff(transport, num_bytes, ms):
                sent.kv_transfer = (transport, num_bytes, ms)
            case CachedTokens(count):
                sent.cached_prompt_tokens = count
            case WorkerTimings(breakdown):
                sent.worker_parts(breakdown)
        return []

    def release(self, releaser: Releaser) -> None:
        """Free what workers hold for the request and no worker took over: the KV session, the embeddings."""
        if self.session is not None:
            self.session.release()
        releaser.embeddings(self.embeddings)
        self.embeddings = []

    def _end_with(self, ending: Exception) -> None:
        if self._over or self._ending is not None:
            return
        self._ending = ending
        if self._task is not None and not self._with_consumer:  # it waits inside the loop: interrupt it there
            self._cancelled_task = True
            self._task.cancel()

    def _ended(self) -> Finished:
        """What a flight ended by cancel() or end() gives its consumer, once its loop has stopped."""
        self._over = True
        if isinstance(self._ending, _Cancelled):
            return self.sent.cancelled()
        self.sent.close(status_of(self._ending))
        raise self._ending from None

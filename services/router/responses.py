"""Request path, last step before the front door: one request's answer (ResponseBuilder), incremental text with stop
strings, then TextDelta / Finished events with usage."""
from __future__ import annotations

import time
from typing import Sequence

import grpc
from opentelemetry import trace

from common.pb.disagg.v1 import common_pb2
from common.telemetry.metrics import Metrics
from common.text_stream import IncrementalDetokenizer
from common.tokenizer import Tokenizer
from services.router.generation import (ChoiceEnd, Event, Finished, FinishReason, TextDelta, TokenLogprob,
                                        TopLogprob, TtftBreakdown, Usage)
from services.router.prepare import PreparedRequest
from services.kit.serving import status_of


class _Choice:
    """One choice's text: its detokenizer (stop strings), the tokens sent, how it ended."""

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer | None, echo: bool):
        self.index = index
        self.detokenizer = detokenizer
        self.echo = echo
        self.opened = False  # its first delta was made (the echo and the prompt's logprobs go in it)
        self.token_ids: list[int] = []
        self.matched_stop: str | None = None
        self.stop_cancelled = False  # its worker was told to stop it (n > 1)
        self.end: ChoiceEnd | None = None


class ResponseBuilder:
    """What the client has been sent for one request: tokens, text, timings (a Flight's `sent`; the flight's loop
    is its only writer).

    Works before `bind` too (a request that fails validation still gets a Finished with usage).
    """

    def __init__(self, request_id: str, tokenizer: Tokenizer | None, started: float | None = None,
                 metrics: Metrics | None = None):
        self.request_id = request_id
        self._metrics = metrics
        self._last_token_at: float | None = None
        self._closed = False
        self._tokenizer = tokenizer
        self._started = time.perf_counter() if started is None else started
        self._first_token_at: float | None = None
        self._prompt: list[int] = []
        self._want_logprobs = False
        self._choices = [_Choice(0, None, False)]  # bind() makes one per choice
        self._prompt_logprobs: tuple[TokenLogprob, ...] = ()  # once they came, until every choice's first delta
        self._scoring = False  # max_tokens 0: the prompt's logprobs only, no token
        self.cached_prompt_tokens = 0
        self.kv_transfer: tuple[str, int, float] = ("", 0, 0.0)  # transport, bytes, ms of the KV handoff
        self._dispatched_at: float | None = None  # the call that produced the first token was sent
        self._worker_parts: dict[str, float] = {}  # TtftBreakdown fields the workers measured
        self.prefilled_remotely = False  # a prefill worker ran the prompt (else the decode worker did)
        self.finished = False

    def bind(self, request: PreparedRequest) -> None:
        self._prompt = request.prompt
        params = request.params
        self._choices = [_Choice(i, IncrementalDetokenizer(self._tokenizer, request.prompt, stop=params.stop)
                                 if self._tokenizer is not None else None, request.echo_prompt_token_ids)
                         for i in range(params.n)]
        self._want_logprobs = params.logprobs
        self._scoring = params.max_tokens == 0

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self._choices)

    @property
    def token_ids(self) -> list[int]:
        """Every token of choice 0 sent to the client, in order (a migration continues from them; n = 1 only)."""
        return self._choices[0].token_ids

    @property
    def matched_stop(self) -> str | None:
        return self._choices[0].matched_stop

    def dispatched(self) -> None:
        """The call that is to produce the first token (Prefill, or the aggregated Decode) is being sent: the router
        queue ends. A later one (the aggregated fallback of a prefill that failed) moves it; after the first token
        nothing does."""
        if self._first_token_at is None:
            self._dispatched_at = time.perf_counter()

    def prefilled(self, breakdown: common_pb2.TtftBreakdown) -> None:
        """A prefill worker answered: its parts of the TTFT breakdown (prefill queue and compute)."""
        self.prefilled_remotely = True
        self.worker_parts(breakdown)

    def worker_parts(self, breakdown: common_pb2.TtftBreakdown) -> None:
        """Keep the TTFT breakdown parts a worker measured (the fields it set)."""
        for field, ms in breakdown.ListFields():
            self._worker_parts[field.name] = ms

    def ttft_breakdown(self) -> TtftBreakdown:
        parts = dict(self._worker_parts)
        if self._dispatched_at is not None:
            parts["router_queue_ms"] = (self._dispatched_at - self._started) * 1000
        return TtftBreakdown(**parts)

    @property
    def stopped(self) -> bool:
        """A stop string matched (n > 1: every choice has stopped or ended): the request is over whatever the
        workers say."""
        return all(c.matched_stop is not None or c.end is not None for c in self._choices)

    def stopped_choices(self) -> list[int]:
        """n > 1: choices whose stop string matched since last asked, for their worker to stop them alone."""
        if len(self._choices) == 1:
            return []
        fresh = [c for c in self._choices if c.matched_stop is not None and c.end is None and not c.stop_cancelled]
        for choice in fresh:
            choice.stop_cancelled = True
        return [c.index for c in fresh]

    def live_choices(self) -> list[int]:
        """The choices that have not ended (nor matched a stop string)."""
        return [c.index for c in self._choices if c.matched_stop is None and c.end is None]

    def prompt_scored(self, logprobs: Sequence[common_pb2.TokenLogprob]) -> None:
        """The prompt's logprobs (prompt_logprobs), for every choice's first delta: one per prompt token, the first
        with logprob None (nothing comes before it)."""
        first = self._with_text(common_pb2.TokenLogprob(token_id=self._prompt[0]))
        self._prompt_logprobs = (TokenLogprob(first.token_id, None, first.text),
                                 *(self._with_text(lp) for lp in logprobs))

    def delta(self, token_ids: Sequence[int], logprobs: Sequence[common_pb2.TokenLogprob] = (),
              index: int = 0) -> TextDelta | None:
        """The delta for newly generated tokens of choice `index` (logprobs as the workers sent them); tokens after
        a matched stop string are dropped, and every token of a request that only scores its prompt."""
        choice = self._choices[index] if index < len(self._choices) else None
        if choice is None or choice.end is not None:
            return None
        kept: list[int] = []
        texts: list[str] = []
        for token in () if self._scoring else token_ids:
            if choice.matched_stop is not None:
                break
            kept.append(token)
            if choice.detokenizer is not None:
                out = choice.detokenizer.add([token])
                texts.append(out.text)
                choice.matched_stop = out.matched_stop
        first = not choice.opened
        if not kept and not (first and (choice.echo or self._prompt_logprobs)):
            return None
        if kept:
            self._timed(len(kept))
        choice.token_ids.extend(kept)
        echoed = tuple(self._prompt) if first and choice.echo else ()
        prompt_logprobs = self._prompt_logprobs if first else ()
        choice.opened = True
        lps = tuple(self._with_text(lp) for lp in logprobs[: len(kept)]) if self._want_logprobs else ()
        return TextDelta(token_ids=tuple(kept), text="".join(texts), logprobs=lps, prompt_token_ids=echoed,
                         index=index, prompt_logprobs=prompt_logprobs)

    def end_choice(self, index: int, reason: FinishReason, matched_stop_token_id: int | None = None) -> list[Event]:
        """n > 1: choice `index` ended (its held-back text, if any); the request goes on until every choice has."""
        choice = self._choices[index]
        if choice.end is not None:
            return []
        events: list[Event] = []
        if choice.detokenizer is not None and choice.matched_stop is None:
            text = choice.detokenizer.flush()
            choice.matched_stop = choice.detokenizer.matched_stop
            if text:
                events.append(TextDelta(text=text, index=index))
        stopped = choice.matched_stop is not None
        choice.end = ChoiceEnd(index, FinishReason.STOP if stopped else reason, len(choice.token_ids),
                               choice.matched_stop or "", None if stopped else matched_stop_token_id)
        return events

    def finish(self, reason: FinishReason, matched_stop_token_id: int | None = None,
               choices: Sequence[tuple[int, FinishReason, int | None]] = ()) -> list[Event]:
        """The held-back text (if any) and the Finished event. n > 1: `choices` says how each choice still running
        ended (index, reason, stop token id); any other takes `reason`."""
        events: list[Event] = []
        if len(self._choices) > 1:
            for index, choice_reason, stop_id in choices:
                events += self.end_choice(index, choice_reason, stop_id)
            for choice in self._choices:
                events += self.end_choice(choice.index, reason)
            ends = tuple(c.end for c in self._choices)
        else:
            events += self.end_choice(0, reason, matched_stop_token_id)
            ends = ()
        end, usage = self._choices[0].end, self.usage()
        events.append(self._finished(Finished(
            reason=end.reason, usage=usage, matched_stop=end.matched_stop,
            matched_stop_token_id=end.matched_stop_token_id, choices=ends)))
        self._report_breakdown(usage)
        self.close(grpc.StatusCode.OK)
        return events

    def failed(self, exc: BaseException) -> Finished:
        """Finished with reason ERROR, carrying the error (each front door maps it to its own status)."""
        self.close(status_of(exc))
        return self._finished(Finished(reason=FinishReason.ERROR, usage=self.usage(), error=exc))

    def cancelled(self) -> Finished:
        self.close(grpc.StatusCode.CANCELLED)
        return self._finished(Finished(reason=FinishReason.CANCELLED, usage=self.usage()))

    def close(self, status: grpc.StatusCode) -> None:
        """Record the request's outcome in the metrics, once (the first outcome wins)."""
        if self._closed or self._metrics is None:
            return
        self._closed = True
        m = self._metrics
        m.get("disagg_requests_total", status=status.name).inc()
        m.get("disagg_e2e_request_latency_seconds").observe(time.perf_counter() - self._started)
        m.get("disagg_prompt_tokens_total").inc(len(self._prompt))
        m.get("disagg_generation_tokens_total").inc(self.completion_tokens)
        m.get("disagg_prefix_cache_hit_tokens_total").inc(self.cached_prompt_tokens)

    def usage(self) -> Usage:
        now = time.perf_counter()
        ttft = (self._first_token_at - self._started) * 1000 if self._first_token_at is not None else 0.0
        transport, nbytes, ms = self.kv_transfer
        return Usage(prompt_tokens=len(self._prompt), completion_tokens=self.completion_tokens,
                     cached_prompt_tokens=self.cached_prompt_tokens, ttft_ms=ttft,
                     e2e_ms=(now - self._started) * 1000, kv_transfer_backend=transport,
                     kv_transfer_bytes=nbytes, kv_transfer_ms=ms, ttft_breakdown=self.ttft_breakdown())

    def _report_breakdown(self, usage: Usage) -> None:
        """A finished request's TTFT breakdown as attributes of the current (the request's) span and in the
        disagg_ttft_breakdown_seconds histogram, by part and by where the prompt ran."""
        if self._first_token_at is None:
            return
        mode = "prefill_decode" if self.prefilled_remotely else "aggregated"
        span = trace.get_current_span()
        span.set_attribute("disagg.ttft_ms", usage.ttft_ms)
        span.set_attribute("disagg.ttft.mode", mode)
        for name, ms in usage.ttft_breakdown.parts().items():
            span.set_attribute(f"disagg.ttft.{name}", ms)
            if self._metrics is not None:
                self._metrics.get("disagg_ttft_breakdown_seconds", part=name.removesuffix("_ms"),
                                  mode=mode).observe(ms / 1000)

    def _timed(self, num_tokens: int) -> None:
        now = time.perf_counter()
        if self._first_token_at is None:
            self._first_token_at = now
            trace.get_current_span().add_event("first_token")
            if self._metrics is not None:
                self._metrics.get("disagg_time_to_first_token_seconds").observe(now - self._started)
        elif self._metrics is not None:  # the gap since the last delta, shared by its tokens
            itl = self._metrics.get("disagg_inter_token_latency_seconds")
            for _ in range(num_tokens):
                itl.observe((now - self._last_token_at) / num_tokens)
        self._last_token_at = now

    def _finished(self, finished: Finished) -> Finished:
        self.finished = True
        return finished

    def _with_text(self, lp: common_pb2.TokenLogprob) -> TokenLogprob:
        decode = self._tokenizer.decode if self._tokenizer is not None else (lambda ids: "")
        top = tuple(TopLogprob(t.token_id, t.logprob, decode([t.token_id])) for t in lp.top_logprobs)
        return TokenLogprob(lp.token_id, lp.logprob, decode([lp.token_id]), top)

"""One request's answer: incremental text with stop strings, then Delta / Finished messages with usage."""
from __future__ import annotations

import time
from typing import Sequence

import grpc
from opentelemetry import trace

from common.tokenizer import Tokenizer
from common.pb.disagg.v1 import common_pb2, generation_pb2
from common.telemetry.metrics import Metrics
from common.text_stream import IncrementalDetokenizer
from services.router.prepare import PreparedRequest
from services.serving import message_of, status_of

Response = generation_pb2.GenerateResponse


class ResponseBuilder:
    """Owns what the client has been sent for one request: tokens, text, timings.

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
        self._detokenizer: IncrementalDetokenizer | None = None
        self._want_logprobs = False
        self._echo_pending = False
        self.completion_tokens = 0
        self.token_ids: list[int] = []  # every token sent to the client, in order
        self.cached_prompt_tokens = 0
        self.kv_transfer: tuple[int, int, float] = (0, 0, 0.0)  # backend, bytes, ms of the KV handoff
        self.matched_stop: str | None = None
        self.finished = False

    def bind(self, request: PreparedRequest) -> None:
        self._prompt = request.prompt
        if self._tokenizer is not None:
            self._detokenizer = IncrementalDetokenizer(self._tokenizer, request.prompt, stop=request.params.stop)
        self._want_logprobs = request.params.logprobs
        self._echo_pending = request.output.echo_prompt_token_ids

    @property
    def stopped(self) -> bool:
        """A stop string matched: the request is over whatever the workers say."""
        return self.matched_stop is not None

    def delta(self, token_ids: Sequence[int], logprobs: Sequence[common_pb2.TokenLogprob] = ()) -> Response | None:
        """The Delta for newly generated tokens; tokens after a matched stop string are dropped."""
        kept: list[int] = []
        texts: list[str] = []
        for token in token_ids:
            if self.stopped:
                break
            kept.append(token)
            if self._detokenizer is not None:
                out = self._detokenizer.add([token])
                texts.append(out.text)
                self.matched_stop = out.matched_stop
        if not kept:
            return None
        now = time.perf_counter()
        if self._first_token_at is None:
            self._first_token_at = now
            trace.get_current_span().add_event("first_token")
            if self._metrics is not None:
                self._metrics.get("disagg_time_to_first_token_seconds").observe(now - self._started)
        elif self._metrics is not None:  # the gap since the last delta, shared by its tokens
            itl = self._metrics.get("disagg_inter_token_latency_seconds")
            for _ in kept:
                itl.observe((now - self._last_token_at) / len(kept))
        self._last_token_at = now
        self.completion_tokens += len(kept)
        self.token_ids.extend(kept)
        delta = common_pb2.Delta(token_ids=kept, text="".join(texts))
        if self._want_logprobs:
            delta.logprobs.extend(self._with_text(lp) for lp in logprobs[: len(kept)])
        if self._echo_pending:
            delta.prompt_token_ids.extend(self._prompt)
            self._echo_pending = False
        return Response(request_id=self.request_id, delta=delta)

    def finish(self, reason: int, matched_stop_token_id: int | None = None) -> list[Response]:
        """The held-back text (if any) and the Finished message."""
        responses = []
        if self._detokenizer is not None and not self.stopped:
            text = self._detokenizer.flush()
            self.matched_stop = self._detokenizer.matched_stop
            if text:
                responses.append(Response(request_id=self.request_id, delta=common_pb2.Delta(text=text)))
        finished = common_pb2.Finished(reason=common_pb2.FINISH_REASON_STOP if self.stopped else reason,
                                       matched_stop=self.matched_stop or "", usage=self.usage())
        if matched_stop_token_id is not None and not self.stopped:
            finished.matched_stop_token_id = matched_stop_token_id
        responses.append(self._finished(finished))
        self.close(grpc.StatusCode.OK)
        return responses

    def failed(self, exc: BaseException) -> Response:
        """Finished with reason ERROR: the status the error maps to, and its message."""
        error = common_pb2.ErrorStatus(code=status_of(exc).value[0], message=message_of(exc) or type(exc).__name__)
        self.close(status_of(exc))
        return self._finished(common_pb2.Finished(reason=common_pb2.FINISH_REASON_ERROR, usage=self.usage(),
                                                  error=error))

    def cancelled(self) -> Response:
        self.close(grpc.StatusCode.CANCELLED)
        return self._finished(common_pb2.Finished(reason=common_pb2.FINISH_REASON_CANCELLED, usage=self.usage()))

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

    def usage(self) -> common_pb2.Usage:
        now = time.perf_counter()
        ttft = (self._first_token_at - self._started) * 1000 if self._first_token_at is not None else 0.0
        return common_pb2.Usage(prompt_tokens=len(self._prompt), completion_tokens=self.completion_tokens,
                                cached_prompt_tokens=self.cached_prompt_tokens, ttft_ms=ttft,
                                e2e_ms=(now - self._started) * 1000, kv_transfer_backend=self.kv_transfer[0],
                                kv_transfer_bytes=self.kv_transfer[1], kv_transfer_ms=self.kv_transfer[2])

    def _finished(self, finished: common_pb2.Finished) -> Response:
        self.finished = True
        return Response(request_id=self.request_id, finished=finished)

    def _with_text(self, lp: common_pb2.TokenLogprob) -> common_pb2.TokenLogprob:
        out = common_pb2.TokenLogprob()
        out.CopyFrom(lp)
        if self._tokenizer is not None:
            out.text = self._tokenizer.decode([lp.token_id])
            for top in out.top_logprobs:
                top.text = self._tokenizer.decode([top.token_id])
        return out

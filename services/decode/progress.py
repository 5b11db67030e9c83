"""A Decode stream's progress: engine outputs as stream messages, and the request's usage."""
from __future__ import annotations

import time

from common.engine.request import FinishReason, RequestOutput
from common.pb.disagg.v1 import common_pb2, worker_pb2
from services.kit.convert import finish_reason_to_proto, logprob_to_proto, logprobs_to_proto
from services.worker.ttft import handoff_parts, prompt_parts


class Progress:
    """Turns engine outputs into stream messages and keeps the usage of this request. With several choices each
    delta carries its index, and one Finished comes when every choice has ended, listing how each did."""

    def __init__(self, request_id: str, num_prompt_tokens: int, choices: list[int] | None = None):
        self.request_id = request_id
        self.choices = choices or [0]
        self.ended: dict[int, common_pb2.ChoiceFinished] = {}
        self.cancelled: set[int] = set()  # choices the router cancelled alone (a stop string matched)
        self.usage = common_pb2.Usage(prompt_tokens=num_prompt_tokens)
        self.start = time.perf_counter()
        self.received = time.monotonic()  # the engine's clock, for the TTFT breakdown
        self.kv_landed_at: float | None = None  # with a session: when its KV was in hand (or its pull gave up)

    def kv_landed(self) -> None:
        self.kv_landed_at = time.monotonic()

    def messages(self, out: RequestOutput) -> list[worker_pb2.DecodeServerMessage]:
        messages = []
        if out.new_token_ids:
            if self.usage.completion_tokens == 0:
                self.usage.ttft_ms = (time.perf_counter() - self.start) * 1000
                self.usage.ttft_breakdown.CopyFrom(prompt_parts(self.received, out) if self.kv_landed_at is None
                                                   else handoff_parts(self.received, self.kv_landed_at, out))
            self.usage.completion_tokens += len(out.new_token_ids)  # tokens generated here, not prefill's first
            delta = common_pb2.Delta(token_ids=out.new_token_ids, index=out.index,
                                     logprobs=[logprob_to_proto(lp) for lp in out.new_logprobs],
                                     prompt_logprobs=logprobs_to_proto(out.prompt_logprobs))
            messages.append(worker_pb2.DecodeServerMessage(request_id=self.request_id, delta=delta))
        if out.index == self.choices[0]:
            self.usage.cached_prompt_tokens = out.num_cached_tokens
        if out.finished and len(self.choices) == 1:
            messages.append(self.finished(out))
        elif out.finished:
            self.ended[out.index] = _choice_finished(out)
            if len(self.ended) == len(self.choices):
                messages.append(self.finished())
        return messages

    def finished(self, out: RequestOutput | None = None) -> worker_pb2.DecodeServerMessage:
        """The last message; without an output (and with choices not all ended), the request was cancelled."""
        self.usage.e2e_ms = (time.perf_counter() - self.start) * 1000
        if len(self.choices) > 1:
            ends = [self.ended.get(i) or common_pb2.ChoiceFinished(index=i, reason=common_pb2.FINISH_REASON_CANCELLED)
                    for i in self.choices]
            finished = common_pb2.Finished(reason=ends[0].reason, usage=self.usage, choices=ends)
            return worker_pb2.DecodeServerMessage(request_id=self.request_id, finished=finished)
        reason = out.finish_reason if out is not None else FinishReason.ABORT
        finished = common_pb2.Finished(reason=finish_reason_to_proto(reason), usage=self.usage)
        if reason is FinishReason.STOP and out.new_token_ids:  # workers stop on token ids; the router on strings
            finished.matched_stop_token_id = out.new_token_ids[-1]
        return worker_pb2.DecodeServerMessage(request_id=self.request_id, finished=finished)


def join_delta(message: worker_pb2.DecodeServerMessage, following: object) -> bool:
    """Append `following`'s tokens and logprobs to `message` where the two can be one Delta (both deltas of one
    choice, and `following` not a choice's first, which carries the prompt's logprobs alone); False, and `message`
    unchanged, where not. What a stream that fell behind its writes sends as one message (Decode and DecodeMany)."""
    if not (isinstance(following, worker_pb2.DecodeServerMessage) and message.HasField("delta")
            and following.HasField("delta") and following.delta.index == message.delta.index
            and not following.delta.prompt_logprobs):
        return False
    message.delta.token_ids.extend(following.delta.token_ids)
    message.delta.logprobs.extend(following.delta.logprobs)
    return True


def _choice_finished(out: RequestOutput) -> common_pb2.ChoiceFinished:
    end = common_pb2.ChoiceFinished(index=out.index, reason=finish_reason_to_proto(out.finish_reason),
                                    completion_tokens=out.num_output_tokens)
    if out.finish_reason is FinishReason.STOP and out.new_token_ids:
        end.matched_stop_token_id = out.new_token_ids[-1]
    return end

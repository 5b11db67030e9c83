"""A worker's parts of a request's TTFT breakdown (disagg.v1.TtftBreakdown, whose comments define each part).

Durations on this process's monotonic clock: from when the servicer received the request, to the engine's stamps
on the output carrying the first generated token (RequestOutput.first_scheduled_time, first_token_time); each stamp
is taken after the one before it, so no part is negative. An engine that does not stamp (trtllm) has its whole
received → first token counted as compute.
"""
from __future__ import annotations

import time

from common.engine.request import RequestOutput
from common.pb.disagg.v1 import common_pb2


def _ms(seconds: float) -> float:
    return seconds * 1000


def _first_token_at(out: RequestOutput) -> float:
    return out.first_token_time if out.first_token_time is not None else time.monotonic()


def prompt_parts(received: float, out: RequestOutput) -> common_pb2.TtftBreakdown:
    """prefill_queue_ms and prefill_compute_ms, on the worker that ran the prompt (prefill, or aggregated decode)."""
    first_token = _first_token_at(out)
    scheduled = out.first_scheduled_time if out.first_scheduled_time is not None else received
    return common_pb2.TtftBreakdown(prefill_queue_ms=_ms(scheduled - received),
                                    prefill_compute_ms=_ms(first_token - scheduled))


def handoff_parts(received: float, kv_landed: float, out: RequestOutput) -> common_pb2.TtftBreakdown:
    """kv_handoff_ms and first_decode_step_ms, on a decode worker that continued from a prefill worker's KV."""
    return common_pb2.TtftBreakdown(kv_handoff_ms=_ms(kv_landed - received),
                                    first_decode_step_ms=_ms(_first_token_at(out) - kv_landed))

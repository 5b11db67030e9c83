"""The router's TTFT breakdown (ResponseBuilder): the router queue it measures, the parts the workers send, in
Usage, in the gRPC Finished, in the histogram by part and mode, and as attributes of the request's span."""
import pytest
from opentelemetry.sdk.trace import TracerProvider

from common.pb.disagg.v1 import common_pb2
from common.telemetry.metrics import Metrics
from services.router import responses
from services.router.frontends.grpc_convert import usage_to_proto
from services.router.frontends.openai_responses import usage_json
from services.router.generation import FinishReason
from services.router.responses import ResponseBuilder

PARTS = ("router_queue", "prefill_queue", "prefill_compute", "kv_handoff", "first_decode_step")


class Clock:
    """Stands in for the time module in responses.py: perf_counter reads `now`."""

    def __init__(self, now: float):
        self.now = now

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock(100.0)
    monkeypatch.setattr(responses, "time", clock)
    return clock


def _builder(clock: Clock) -> tuple[ResponseBuilder, Metrics]:
    metrics = Metrics.create("router", "m")
    return ResponseBuilder("r", None, started=clock.now, metrics=metrics), metrics


def _observed(metrics: Metrics, part: str, mode: str) -> tuple[float | None, float | None]:
    labels = {"model": "m", "role": "router", "part": part, "mode": mode}
    return (metrics.registry.get_sample_value("disagg_ttft_breakdown_seconds_count", labels),
            metrics.registry.get_sample_value("disagg_ttft_breakdown_seconds_sum", labels))


def _by_field(values: tuple[float, ...]) -> dict[str, float]:
    return {f"{part}_ms": ms for part, ms in zip(PARTS, values)}


def _finish_in_span(builder: ResponseBuilder):
    with TracerProvider().get_tracer("test").start_as_current_span("request") as span:
        finished = builder.finish(FinishReason.LENGTH)[-1]
    return finished, span


def test_prefill_then_decode_has_every_part_and_the_first_three_lead_to_the_first_token(clock):
    builder, metrics = _builder(clock)
    clock.now += 0.004
    builder.dispatched()  # the Prefill call
    builder.prefilled(common_pb2.TtftBreakdown(prefill_queue_ms=3.0, prefill_compute_ms=20.0))
    clock.now += 0.030
    builder.delta([5])  # prefill's first token reaches the client
    clock.now += 0.002
    builder.dispatched()  # the Decode call comes after the first token: not the router queue
    builder.worker_parts(common_pb2.TtftBreakdown(kv_handoff_ms=2.0, first_decode_step_ms=6.0))
    builder.delta([6])
    finished, span = _finish_in_span(builder)

    usage = finished.usage
    assert usage.ttft_ms == pytest.approx(34.0)
    assert usage.ttft_breakdown.parts() == pytest.approx(_by_field((4.0, 3.0, 20.0, 2.0, 6.0)))
    assert usage.ttft_breakdown.to_first_token_ms == pytest.approx(27.0)  # ttft less the Prefill call's transit
    proto = usage_to_proto(usage).ttft_breakdown
    assert [getattr(proto, f"{p}_ms") for p in PARTS] == pytest.approx([4.0, 3.0, 20.0, 2.0, 6.0])
    for part, ms in zip(PARTS, (4.0, 3.0, 20.0, 2.0, 6.0)):
        assert _observed(metrics, part, "prefill_decode") == pytest.approx((1, ms / 1000))
        assert span.attributes[f"disagg.ttft.{part}_ms"] == pytest.approx(ms)
    assert span.attributes["disagg.ttft.mode"] == "prefill_decode"
    assert span.attributes["disagg.ttft_ms"] == pytest.approx(34.0)
    assert usage_json(usage)["ttft_breakdown"] == pytest.approx(_by_field((4.0, 3.0, 20.0, 2.0, 6.0)))
    assert usage_json(usage)["ttft_ms"] == pytest.approx(34.0)  # the router's own, beside its parts


def test_aggregated_has_no_kv_handoff_nor_first_decode_step(clock):
    builder, metrics = _builder(clock)
    clock.now += 0.001
    builder.dispatched()  # the aggregated Decode call
    clock.now += 0.012
    builder.delta([5])
    builder.worker_parts(common_pb2.TtftBreakdown(prefill_queue_ms=1.0, prefill_compute_ms=10.0))  # its Finished
    finished, span = _finish_in_span(builder)

    breakdown = finished.usage.ttft_breakdown
    assert breakdown.parts() == pytest.approx(_by_field((1.0, 1.0, 10.0)))
    assert breakdown.kv_handoff_ms is None and breakdown.first_decode_step_ms is None
    proto = usage_to_proto(finished.usage).ttft_breakdown
    assert not proto.HasField("kv_handoff_ms") and not proto.HasField("first_decode_step_ms")
    assert proto.kv_handoff_ms == 0  # to a reader that ignores presence
    assert _observed(metrics, "prefill_compute", "aggregated") == pytest.approx((1, 0.010))
    assert _observed(metrics, "kv_handoff", "aggregated") == (None, None)
    assert _observed(metrics, "prefill_compute", "prefill_decode") == (None, None)
    assert span.attributes["disagg.ttft.mode"] == "aggregated" and "disagg.ttft.kv_handoff_ms" not in span.attributes


def test_a_prefill_that_fails_over_to_aggregated_is_in_the_router_queue(clock):
    builder, _ = _builder(clock)
    clock.now += 0.005
    builder.dispatched()  # the Prefill call, which fails
    clock.now += 0.004
    builder.dispatched()  # the aggregated Decode call: its first token is the request's
    clock.now += 0.010
    builder.delta([5])
    assert builder.usage().ttft_breakdown.router_queue_ms == pytest.approx(9.0)


def test_a_request_without_a_first_token_observes_nothing(clock):
    builder, metrics = _builder(clock)
    assert usage_json(builder.usage()).keys() == {"prompt_tokens", "completion_tokens", "total_tokens",
                                                   "prompt_tokens_details"}  # OpenAI's fields only
    clock.now += 0.003
    builder.dispatched()
    finished, span = _finish_in_span(builder)
    assert finished.usage.ttft_ms == 0
    assert finished.usage.ttft_breakdown.parts() == pytest.approx({"router_queue_ms": 3.0})  # what was measured
    assert _observed(metrics, "router_queue", "aggregated") == (None, None)
    assert "disagg.ttft_ms" not in span.attributes

"""common.telemetry.metrics: names follow Prometheus conventions, labels model and role, the HTTP endpoint serves
them, and a worker's Load becomes its gauges with the expired-sessions counter only ever counting up."""
from __future__ import annotations

import urllib.request

import pytest

from prometheus_client.parser import text_string_to_metric_families

from common.pb.disagg.v1 import worker_pb2
from common.engine.step_facts import StepFacts, step_facts
from common.telemetry.metrics import METRICS, Metrics, observe_engine_load, observe_engine_step


def _samples(metrics: Metrics) -> dict[str, float]:
    from prometheus_client import generate_latest

    found = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            assert sample.labels["model"] == "m" and sample.labels["role"] == "decode"
            found[sample.name] = sample.value
    return found


def test_names_follow_prometheus_conventions():
    for name, (kind, help_text, _) in METRICS.items():
        assert name.startswith("disagg_") and help_text
        assert name.endswith("_total") == (kind == "counter"), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name
        assert "milliseconds" not in name and "_ms" not in name
    required = {"disagg_time_to_first_token_seconds", "disagg_inter_token_latency_seconds",
                "disagg_e2e_request_latency_seconds", "disagg_requests_running", "disagg_requests_waiting",
                "disagg_prompt_tokens_total", "disagg_generation_tokens_total", "disagg_kv_cache_usage_ratio",
                "disagg_kv_cache_free_blocks", "disagg_prefix_cache_hit_tokens_total",
                "disagg_kv_sessions_exported_total", "disagg_kv_sessions_pulled_total",
                "disagg_kv_sessions_expired_total", "disagg_kv_pull_bytes_total", "disagg_kv_pull_seconds",
                "disagg_encode_latency_seconds", "disagg_requests_total"}
    assert required <= set(METRICS)


def test_engine_load_becomes_gauges_and_expired_sessions_and_preemptions_count_up():
    metrics = Metrics.create("decode", "m")
    load = worker_pb2.Load(running_requests=3, waiting_requests=2, kv_blocks_total=10, kv_blocks_free=4,
                           kv_usage_ratio=0.6, active_kv_sessions=1, expired_kv_sessions=2, preemptions=3)
    observe_engine_load(metrics, load)
    observe_engine_load(metrics, load)  # the same cumulative count again adds nothing
    samples = _samples(metrics)
    assert samples["disagg_requests_running"] == 3 and samples["disagg_requests_waiting"] == 2
    assert samples["disagg_kv_cache_usage_ratio"] == pytest.approx(0.6) and samples["disagg_kv_cache_free_blocks"] == 4
    assert samples["disagg_kv_sessions_expired_total"] == 2 and samples["disagg_preemptions_total"] == 3
    load.expired_kv_sessions, load.preemptions = 5, 4
    observe_engine_load(metrics, load)
    assert _samples(metrics)["disagg_kv_sessions_expired_total"] == 5
    assert _samples(metrics)["disagg_preemptions_total"] == 4


def test_an_engine_step_is_counted_by_its_kind_and_its_period_by_the_step_that_began_it():
    from prometheus_client import generate_latest

    metrics = Metrics.create("decode", "m")
    mixed, decode = StepFacts("mixed", 3, launched_ahead=False), StepFacts("decode", 4, launched_ahead=True)
    observe_engine_step(metrics, mixed, 0.02, 0.015, None)  # the first step after an idle wait closes no period
    observe_engine_step(metrics, decode, 0.004, 0.003, (mixed, 0.021))
    observe_engine_step(metrics, decode, 0.004, 0.001, (decode, 0.005))
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model", "role")))): s.value
               for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               for s in family.samples}
    assert samples["disagg_engine_step_seconds_count", (("kind", "decode"),)] == 2
    assert samples["disagg_engine_step_seconds_sum", (("kind", "mixed"),)] == pytest.approx(0.02)
    assert samples["disagg_engine_step_cpu_seconds_total", (("kind", "decode"),)] == pytest.approx(0.004)
    assert samples["disagg_engine_step_sequences_total", (("kind", "decode"),)] == 8
    period = "disagg_engine_step_period_seconds"
    assert samples[f"{period}_sum", (("kind", "mixed"), ("launched_ahead", "no"))] == pytest.approx(0.021)
    assert samples[f"{period}_count", (("kind", "decode"), ("launched_ahead", "yes"))] == 1
    assert samples[f"{period}_bucket", (("kind", "decode"), ("launched_ahead", "yes"), ("le", "0.005"))] == 1
    assert samples[f"{period}_bucket", (("kind", "decode"), ("launched_ahead", "yes"), ("le", "0.004"))] == 0


def test_a_step_is_decode_prefill_or_mixed_by_its_rows():
    """... and counts its new tokens (a prefill step's prompt tokens: what the tiers' hit cost divides by)."""
    assert step_facts([("a", 1), ("b", 1)], launched_ahead=True) == StepFacts("decode", 2, True, tokens=2)
    assert step_facts([("a", 512)], launched_ahead=False) == StepFacts("prefill", 1, False, tokens=512)
    assert step_facts([("a", 1), ("b", 256)], launched_ahead=False).kind == "mixed"


def test_the_endpoint_serves_the_registry_on_a_free_port():
    metrics = Metrics.create("decode", "m")
    metrics.get("disagg_kv_pull_bytes_total", backend="cuda_ipc").inc(1024)
    metrics.get("disagg_requests_total", status="CANCELLED").inc()
    with metrics.get("disagg_encode_latency_seconds").time():
        pass
    port = metrics.serve("127.0.0.1", 0)
    assert port > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'disagg_kv_pull_bytes_total{backend="cuda_ipc",model="m",role="decode"} 1024.0' in text
    assert 'disagg_requests_total{model="m",role="decode",status="CANCELLED"} 1.0' in text
    assert 'disagg_encode_latency_seconds_count{model="m",role="decode"} 1.0' in text

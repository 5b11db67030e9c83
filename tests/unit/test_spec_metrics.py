"""Speculative decoding's counts: per method, by position, the mean accepted length, and the Prometheus sink."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from common.engine.spec.metrics import SpecMetrics
from common.telemetry.metrics import METRICS


class _Sink:
    """common.telemetry.metrics.Metrics's get(name, **labels), over a registry of METRICS alone."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.families = {name: Counter(name.removesuffix("_total"), help_text, ("model", "role", *extra),
                                       registry=self.registry)
                         for name, (kind, help_text, extra) in METRICS.items() if kind == "counter"}

    def get(self, name: str, **labels: str):
        return self.families[name].labels(model="m", role="decode", **labels)


def test_a_steps_rows_count_drafts_tokens_and_positions():
    metrics = SpecMetrics()
    metrics.verified("ngram", proposed=[4, 4, 0, 2], accepted=[4, 1, 0, 0])
    metrics.verified("ngram", proposed=[3], accepted=[2])
    assert metrics.total("disagg_spec_decode_drafts_total", method="ngram") == 4  # the row without drafts skipped
    assert metrics.total("disagg_spec_decode_draft_tokens_total", method="ngram") == 13
    assert metrics.total("disagg_spec_decode_accepted_tokens_total", method="ngram") == 7
    assert metrics.acceptance_by_position("ngram", 4) == [0.75, 0.5, 0.25, 0.25]
    assert metrics.mean_accepted_length("ngram") == pytest.approx(1 + 7 / 4)
    assert metrics.mean_accepted_length("draft") == 1.0 and metrics.acceptance_by_position("draft", 2) == [0.0, 0.0]


def test_plain_steps_count_by_reason():
    metrics = SpecMetrics()
    metrics.plain("ngram", "off", 3)
    metrics.plain("ngram", "no_draft")
    assert metrics.total("disagg_spec_decode_plain_steps_total", method="ngram", reason="off") == 3
    with pytest.raises(ValueError, match="reason 'slow'"):
        metrics.plain("ngram", "slow")


def test_bound_sink_exports_what_is_counted():
    metrics, sink = SpecMetrics(), _Sink()
    metrics.verified("ngram", proposed=[2], accepted=[2])  # before bind: kept here only
    metrics.bind(sink)
    metrics.verified("ngram", proposed=[3, 1], accepted=[1, 0])
    metrics.plain("ngram", "off")
    text = generate_latest(sink.registry).decode()
    assert 'disagg_spec_decode_drafts_total{method="ngram",model="m",role="decode"} 2.0' in text
    assert 'disagg_spec_decode_accepted_tokens_per_pos_total{method="ngram",model="m",position="0",role="decode"} ' \
           '1.0' in text
    assert 'disagg_spec_decode_plain_steps_total{method="ngram",model="m",reason="off",role="decode"} 1.0' in text
    assert metrics.total("disagg_spec_decode_drafts_total", method="ngram") == 3


def test_metric_names_follow_the_projects_conventions():
    spec = {name: entry for name, entry in METRICS.items() if name.startswith("disagg_spec_decode_")}
    assert len(spec) == 5
    for name, (kind, help_text, extra) in spec.items():
        assert name.endswith("_total") == (kind == "counter")
        assert help_text.endswith(".") and "method" in extra

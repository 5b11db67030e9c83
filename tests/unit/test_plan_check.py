"""benchmarks/plan_check.py's judgement of a measured rate: the SLO's figures over a bench's requests as the
predictor counts them, the backlog test, the measured goodput of a ladder, and the flags each `disagg up` gets."""
from __future__ import annotations

import pytest

from benchmarks.plan_check import backlog_growth, measured_figures, measured_goodput, meets, up_engine_flags
from services.planner.workload import parse_slo

SLO = parse_slo("ttft_p90=100ms,itl_p99=20ms")


def bench_json(ttfts, itls, e2es, failed=0) -> dict:
    requests = [{"sent_s": float(i), "ttft_ms": t, "e2e_ms": e, "itl_ms": gaps, "error": None}
                for i, (t, gaps, e) in enumerate(zip(ttfts, itls, e2es))]
    requests += [{"sent_s": 99.0, "ttft_ms": None, "e2e_ms": None, "itl_ms": [], "error": "UNAVAILABLE"}] * failed
    return {"summary": {"failed": failed}, "requests": requests}


def test_figures_count_ttft_per_request_and_itl_over_every_gap():
    ttfts = [10.0] * 9 + [500.0]
    itls = [[5.0] * 99] * 9 + [[50.0]]  # one slow gap among 892: under the p99
    figures = measured_figures(bench_json(ttfts, itls, [200.0] * 10), SLO)
    assert figures["ttft_p90"] == pytest.approx(0.059)  # numpy's linear interpolation between 10 and 500 ms
    assert figures["itl_p99"] == pytest.approx(0.005)
    assert figures["failed"] == 0 and figures["backlog_growth"] == pytest.approx(1.0)
    assert meets(figures, SLO)


def test_a_failed_request_or_a_growing_backlog_is_not_met():
    ok = bench_json([10.0] * 8, [[5.0]] * 8, [100.0] * 8)
    assert meets(measured_figures(ok, SLO), SLO)
    assert not meets(measured_figures(bench_json([10.0] * 8, [[5.0]] * 8, [100.0] * 8, failed=1), SLO), SLO)
    growing = bench_json([10.0] * 8, [[5.0]] * 8, [100.0 * (i + 1) for i in range(8)])
    assert backlog_growth(growing["requests"]) == pytest.approx(750 / 350)
    assert not meets(measured_figures(growing, SLO), SLO)


def test_the_measured_goodput_is_the_highest_met_rate_of_the_ladder():
    assert measured_goodput([(1.0, True), (2.0, True), (3.0, False), (4.0, False)]) == 2.0
    assert measured_goodput([(1.0, True), (2.0, False), (3.0, True)]) == 3.0  # as measured: noise is not hidden
    assert measured_goodput([(1.0, False)]) == 0.0


def test_each_up_gets_the_engine_flags_and_none_of_the_planning_ones():
    rest = ["--model", "/m", "--workload", "in=8,out=8", "--slo=ttft_p90=1s", "--device", "cpu", "--reprofile",
            "--profile-grid", "lengths=8", "--max-num-seqs", "4"]
    assert up_engine_flags(rest) == ["--model", "/m", "--device", "cpu", "--max-num-seqs", "4"]

"""The multi-GPU bench's comparison of each split with the best aggregated run (benchmarks/multi_gpu.py): which
aggregated run is the peer, the ratio of SLO rates, and the per-rate ratios only where both points ran below
saturation."""
import argparse

from prometheus_client import generate_latest

from benchmarks.multi_gpu import (CLIENT_TOK_S, ROUTER_TOK_S, apparatus_bound, comparison, mean_ms_by_role,
                                  pool_note, replicas, saturated, table)
from benchmarks.scrape import samples
from benchmarks.step_metrics import step_summary, window
from common.engine.step_facts import StepFacts
from common.telemetry.metrics import Metrics, observe_engine_step

ARGS = argparse.Namespace(slo_ttft_p90_ms=250.0, slo_itl_p99_ms=15.0)


def point(layout: str, label: str, rate: float, ttft_p90: float, itl_p99: float, tok_s: float,
          achieved: float | None = None, failed: int = 0) -> dict:
    meets = ttft_p90 <= ARGS.slo_ttft_p90_ms and itl_p99 <= ARGS.slo_itl_p99_ms
    return {"layout": layout, "label": label, "rate": rate, "ttft_p90_ms": ttft_p90, "itl_p99_ms": itl_p99,
            "output_tok_s": tok_s, "achieved_req_s": rate * 0.9 if achieved is None else achieved, "failed": failed,
            "meets_slo": meets}


RESULTS = [
    point("2xagg", "2xagg chunk 512", 40, 110.0, 12.0, 4500.0),
    point("2xagg", "2xagg chunk 512", 48, 320.0, 17.0, 5300.0),
    point("2xagg", "2xagg chunk 1024", 40, 100.0, 18.0, 4500.0),  # misses everywhere: not the peer
    point("1P1D", "1P1D", 40, 80.0, 4.0, 4600.0),
    point("1P1D", "1P1D", 48, 100.0, 8.0, 5300.0),
    point("1P1D", "1P1D", 64, 190.0, 9.0, 7000.0),
    point("1P1D", "1P1D", 80, 1200.0, 14.0, 8000.0, achieved=50.0),  # saturated: no ratio at 80
]


def test_each_split_against_the_best_aggregated_run():
    lines = comparison(RESULTS, ARGS)
    assert "best aggregated run (2xagg chunk 512;" in lines[1]
    rows = [line for line in lines if line.startswith("| 1P1D |")]
    assert rows == [
        "| 1P1D | 64 against 40 (1.60×) | 40 | 3.00× | 0.73× | 1.02× |",
        # aggregated at 48 misses the SLO but is not saturated (90 % completed, TTFT p90 under 4 × 250 ms)
        "| 1P1D | 64 against 40 (1.60×) | 48 | 2.12× | 0.31× | 1.00× |",
    ]


def test_no_comparison_without_both_kinds():
    only_splits = [r for r in RESULTS if r["layout"] == "1P1D"]
    assert comparison(only_splits, ARGS) == []
    assert comparison([r for r in RESULTS if r["layout"] == "2xagg"], ARGS) == []


def test_saturation_is_a_failure_a_low_completion_rate_or_a_runaway_ttft():
    assert not saturated(point("1P1D", "x", 64, 190.0, 9.0, 1.0), ARGS)
    assert saturated(point("1P1D", "x", 64, 190.0, 9.0, 1.0, failed=1), ARGS)
    assert saturated(point("1P1D", "x", 64, 190.0, 9.0, 1.0, achieved=47.9), ARGS)
    assert saturated(point("1P1D", "x", 64, 1001.0, 9.0, 1.0), ARGS)


def test_step_summary_reads_a_points_decode_steps_from_the_workers_step_metrics():
    # Steps before the point's window are left out; in it, 20 decode periods of 5 ms begun by steps launched ahead,
    # then 5 of 20 ms begun by mixed steps (a prompt chunk beside the decode rows) that were not.
    metrics = Metrics.create("decode", "m")
    decode, mixed = StepFacts("decode", 8, launched_ahead=True), StepFacts("mixed", 8, launched_ahead=False)
    for _ in range(10):
        observe_engine_step(metrics, decode, 0.1, 0.1, (decode, 1.0))
    before = samples(generate_latest(metrics.registry).decode())
    for i in range(25):
        began = mixed if i >= 20 else decode
        observe_engine_step(metrics, began, 0.004, 0.001, (began, 0.02 if began is mixed else 0.005))
    after = samples(generate_latest(metrics.registry).decode())
    summary = step_summary(window([after], [before]))
    assert summary["steps"] == 25 and summary["mean_sequences"] == 8.0
    assert 4.0 <= summary["period_p50_ms"] <= 5.0  # read from the (4, 5] ms bucket
    assert summary["period_mean_ms"] == 8.0 and summary["step_wall_mean_ms"] == 4.0
    assert summary["step_cpu_mean_ms"] == 1.0
    assert summary["not_ahead_share"] == 0.2 and summary["long"] == 5 and summary["long_not_ahead"] == 5
    assert summary["mixed_share"] == 0.2 and 17.5 <= summary["mixed_p50_ms"] <= 20.0
    # A window of decode steps alone has no mixed figures; one of fewer than 10 periods, no summary.
    assert "mixed_share" not in step_summary(window([before], [{}]))
    assert step_summary(window([after], [after])) is None


def test_a_pool_smaller_than_the_batch_limit_is_said_before_the_run():
    # uniform 512-2048 prompts and 128 output tokens: 1408 tokens a request on average; 8192 blocks of 16 hold 93
    args = argparse.Namespace(input_len="uniform:512:2048", output_len=128, kv_blocks=8192, max_num_seqs=128)
    assert pool_note(args, block_size=16) == (
        "# note: --kv-blocks 8192 hold about 93 requests of 1408 tokens, fewer than the 128 rows a worker admits "
        "(--max-num-seqs): past 93 rows a decode worker queues handoffs")
    assert pool_note(argparse.Namespace(**{**vars(args), "kv_blocks": 16384}), block_size=16) is None
    assert pool_note(argparse.Namespace(**{**vars(args), "max_num_seqs": 64}), block_size=16) is None
    assert "the 128 rows" in pool_note(argparse.Namespace(**{**vars(args), "max_num_seqs": 0}), block_size=16)


def test_the_measuring_side_scales_with_the_highest_rate():
    # 72 req/s x 128 tokens: 9 216 tok/s, past what one router streams well inside its core
    assert replicas([56, 64, 72], 128, ROUTER_TOK_S) == 2
    assert replicas([8, 16], 128, ROUTER_TOK_S) == 1
    assert replicas([144, 176], 128, CLIENT_TOK_S) == 8


def test_a_point_says_which_router_or_client_it_measured_through():
    before = {"router-0": 10.0, "router-1": 10.0}
    after = {"router-0": 19.0, "router-1": 14.0}  # 0.9 and 0.4 of a core over 10 s
    assert apparatus_bound(before, after, [], bench_cores=1.0, clients=2, seconds=10.0) == ["router-0 0.90 cores"]
    assert apparatus_bound(before, after, [], bench_cores=1.8, clients=2, seconds=10.0) == [
        "router-0 0.90 cores", "bench clients 0.90 cores each"]
    assert apparatus_bound(before, {"router-0": 12.0}, [], bench_cores=0.5, clients=1, seconds=10.0) == []
    # a bench that reports its loops is judged by them, not by its processes' CPU (their start, the summary)
    quiet = {"router-0": 12.0}
    assert apparatus_bound(before, quiet, [0.41, 0.52], bench_cores=1.8, clients=2, seconds=10.0) == []
    assert apparatus_bound(before, quiet, [0.41, 0.93], bench_cores=1.0, clients=2, seconds=10.0) == [
        "bench client loop 0.93 cores (the busiest of 2)"]
    # the table says so beside the verdicts
    rows = [dict(r, ttft_mean_ms=1.0, tpot_mean_ms=1.0, goodput_req_s=1.0, kv_pull_mean_ms=None) for r in RESULTS[:6]]
    rows[5]["apparatus_bound"] = ["router-0 0.90 cores"]
    text = table(rows, argparse.Namespace(**vars(ARGS), input_len="uniform:512:2048",
                                          output_len=128, num_prompts=200, point_s=6.0))
    assert "Measured through a saturated router or bench client" in text
    assert "1P1D at 64 (router-0 0.90 cores)" in text


def test_a_points_output_wait_is_each_roles_mean_over_the_point():
    before = {"prefill": (1.0, 100.0), "decode": (0.5, 1000.0)}
    after = {"prefill": (1.3, 150.0), "decode": (0.5, 1000.0)}  # decode stepped no more: nothing to say
    assert mean_ms_by_role(after, before) == {"prefill": 6.0}


def test_a_points_waits_read_each_histogram_as_a_scrape_keys_it(monkeypatch):
    # tests.integration.observed.scrape drops model and role: an unlabelled histogram's sum and count are bare names
    import benchmarks.multi_gpu as multi_gpu

    name = "disagg_engine_output_wait_seconds"
    scraped = {"prefill": {f"{name}_sum": 0.5, f"{name}_count": 10.0, f'{name}_bucket{{le="0.001"}}': 3.0},
               "decode": {f"{name}_sum": 0.25, f"{name}_count": 50.0}}
    scraped["router"] = {"disagg_event_loop_lag_seconds_sum": 0.2, "disagg_event_loop_lag_seconds_count": 40.0}
    processes = [_Process(role) for role in ("prefill", "decode", "decode", "router")]
    monkeypatch.setattr(multi_gpu, "scrape", lambda process: scraped[process.role])
    monkeypatch.setattr(multi_gpu, "cpu_seconds", lambda pid: 1.0)
    reading = multi_gpu.Reading.of(processes)  # one scrape of each process serves every figure of the point
    assert multi_gpu.wait_totals(reading) == {"output_wait_ms": {"prefill": (0.5, 10.0), "decode": (0.5, 100.0)},
                                              "loop_lag_ms": {"router": (0.2, 40.0)}}


class _Process:
    """A ServiceProcess as a point's reading sees it: a role, a pid, a name (two of one role stay two)."""

    def __init__(self, role: str, pid: int = 0):
        self.role, self.popen, self.name = role, argparse.Namespace(pid=pid), f"disagg-{role} (pid {pid})"


def test_one_reading_a_side_gives_the_points_pulls_placements_pauses_and_cores(monkeypatch):
    import benchmarks.multi_gpu as multi_gpu

    decode_a, decode_b, router = _Process("decode", 1), _Process("decode", 2), _Process("router", 3)
    pulls = "disagg_kv_pull_seconds_{}{{backend=\"cuda_ipc\"}}"
    placed = 'disagg_routing_prefill_decisions_total{reason="long_uncached",where="remote"}'
    paused = 'disagg_gc_pause_seconds_{}{{generation="2"}}'

    def side(pull_s, pulls_n, placements, pauses, cpu):
        samples = {decode_a: {pulls.format("sum"): pull_s, pulls.format("count"): pulls_n,
                              paused.format("count"): pauses, paused.format("sum"): pauses * 0.01},
                   decode_b: {pulls.format("sum"): pull_s, pulls.format("count"): pulls_n},
                   router: {placed: placements}}
        return multi_gpu.Reading(samples, {decode_a: cpu, decode_b: cpu, router: cpu, "bench": cpu})

    before, after = side(1.0, 1000.0, 10.0, 2.0, 5.0), side(1.2, 1100.0, 60.0, 3.0, 8.0)
    assert multi_gpu.mean_pull_ms(after, before) == 2.0  # 0.4 s over 200 pulls, both decode workers
    assert multi_gpu.decisions(after) == {'reason="long_uncached",where="remote"': 60.0}
    assert multi_gpu.gc_pause_delta(multi_gpu.gc_pauses(after), multi_gpu.gc_pauses(before))["decode"] == [1, 10.0]
    assert multi_gpu.cores_busy(after.role_cpu(), before.role_cpu(), 3.0) == {"decode": 2.0, "router": 1.0,
                                                                             "bench": 1.0}
    assert after.routers_cpu() == {"disagg-router (pid 3)": 8.0}

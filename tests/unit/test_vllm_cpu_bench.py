"""benchmarks/vllm_cpu.py's report: each client's figures for each server beside vLLM's, with the ratio."""
from __future__ import annotations

from benchmarks.vllm_cpu import METRICS, report


def _run(**figures: float) -> dict:
    return {key: 10.0 for key, _, _ in METRICS} | figures


def test_the_report_gives_each_server_the_mean_spread_ratio_and_its_clients_cores():
    results = {"vllm": {"1": [_run(client_cpu_s=3.0, client_wall_s=10.0), _run(client_cpu_s=1.0,
                                                                              client_wall_s=10.0)]},
               "disagg": {"1": [_run(output_tok_s=11.0, ttft_p99_ms=20.0), _run(output_tok_s=13.0,
                                                                                 ttft_p99_ms=20.0)]}}
    text = report(results, [1], ["vllm", "disagg"], "aiperf")
    lines = text.splitlines()
    assert lines[0] == "aiperf, concurrency 1:"
    vllm, ours, ratio = lines[1], lines[2], lines[3]
    assert "client 0.20 cores" in vllm and "client" not in ours  # only where every round recorded it
    assert "out tok/s 12.0 (11.0-13.0)" in ours
    assert ratio.startswith("  disagg / vLLM: out tok/s 1.20x (higher is better)")
    assert "TTFT p99 ms 2.00x (lower is better)" in ratio

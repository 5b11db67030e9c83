"""The sweep's crossover (benchmarks/disagg_sweep_plot.py): the prompt length from which every prefill remote pays
(issue #24's targets: ≥ 0.9× the aggregated throughput, TTFT mean ≤ 1.5×, ITL p99 ≥ 2× better), which becomes the
conditional rule's threshold."""
import math

from benchmarks.disagg_sweep_plot import crossover, crossover_of, plot, table


def _run(mode: str, length: int, output: int, tok_s: float, itl: float = 20.0) -> dict:
    return {"input": str(length), "output": output, "mode": mode, "output_tok_s": tok_s, "ttft_mean_ms": 10.0,
            "ttft_p90_ms": 12.0, "itl_p99_ms": itl, "kv_pulls": 0, "kv_pull_mean_ms": None, "threshold": None}


def test_the_crossover_interpolates_the_itl_gain_in_log_space_after_the_last_cell_that_does_not_pay():
    assert crossover_of([(512, 1.0, False), (2048, 3.0, True)]) == 1024  # gain 2 halfway, in log2
    assert crossover_of([(128, 2.5, True), (512, 2.1, True)]) == 0.0  # pays everywhere
    assert crossover_of([(128, 1.0, False), (8192, 3.0, False)]) == math.inf  # not at the longest
    assert crossover_of([(128, 2.2, True), (512, 1.0, False), (2048, 3.0, True)]) == 1024  # for good only
    assert crossover_of([(512, 2.5, False), (2048, 2.6, True)]) == 512  # 512 failed on throughput: from the cell


def test_the_threshold_is_the_shortest_crossover_over_outputs_rounded_up_or_the_longest_input(tmp_path):
    runs = [_run("aggregated", x, o, 100.0, 20.0) for x in (512, 2048) for o in (32, 256)]
    runs += [_run("remote", 512, 32, 95.0, 20.0), _run("remote", 2048, 32, 80.0, 5.0),  # 2048: throughput too low
             _run("remote", 512, 256, 95.0, 19.0), _run("remote", 2048, 256, 97.0, 8.0)]  # gain 2 near 1270
    assert crossover(runs, ["512", "2048"]) == 1280
    never = [r for r in runs if r["mode"] == "aggregated"] + [_run("remote", x, 32, 50.0) for x in (512, 2048)]
    assert crossover(never, ["512", "2048"]) == 2048
    assert "| 2048 | 256 | remote | 97 (0.97×) |" in table(runs)
    plot(runs, 1280, tmp_path / "sweep.png", "test")
    assert (tmp_path / "sweep.png").stat().st_size > 10_000

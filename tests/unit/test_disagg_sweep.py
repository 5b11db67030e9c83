"""The sweep's crossover (tests/bench/disagg_sweep_plot.py): where every-prefill-remote starts to give at least the
aggregated throughput, which becomes the conditional rule's threshold."""
import math

from tests.bench.disagg_sweep_plot import crossover, crossover_of, plot, table


def _run(mode: str, length: int, output: int, tok_s: float) -> dict:
    return {"input": str(length), "output": output, "mode": mode, "output_tok_s": tok_s, "ttft_mean_ms": 10.0,
            "ttft_p90_ms": 12.0, "itl_p99_ms": 9.0, "kv_pulls": 0, "kv_pull_mean_ms": None, "threshold": None}


def test_the_crossover_interpolates_between_the_two_lengths_around_it_in_log_space():
    assert crossover_of([(512, 0.8), (2048, 1.2)]) == 1024  # halfway in log2
    assert crossover_of([(128, 1.1), (512, 1.0)]) == 0.0  # pays everywhere
    assert crossover_of([(128, 0.5), (8192, 0.9)]) == math.inf  # pays nowhere
    assert crossover_of([(128, 1.2), (512, 0.9), (2048, 1.1)]) == 1024  # for good: after the last dip


def test_the_threshold_is_the_largest_crossover_over_outputs_rounded_up_and_capped_by_the_inputs(tmp_path):
    runs = [_run("aggregated", x, o, 100.0) for x in (512, 2048) for o in (32, 256)]
    runs += [_run("remote", 512, 32, 80.0), _run("remote", 2048, 32, 120.0),  # crosses at 1024
             _run("remote", 512, 256, 90.0), _run("remote", 2048, 256, 101.0)]  # crosses at ~1836
    assert crossover(runs, ["512", "2048"]) == 1856
    never = [r for r in runs if r["mode"] == "aggregated"] + [_run("remote", x, 32, 50.0) for x in (512, 2048)]
    assert crossover(never, ["512", "2048"]) == 2048
    assert "| 2048 | 32 | remote | 120 (1.20×) |" in table(runs)
    plot(runs, 1856, tmp_path / "sweep.png", "test")
    assert (tmp_path / "sweep.png").stat().st_size > 10_000

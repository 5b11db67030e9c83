"""benchmarks.vllm_gpu's parts that need no GPU: the workloads it parses and the table it prints."""
from benchmarks.vllm_gpu import METRICS, Workload, report


def test_a_workload_is_input_output_concurrency_with_a_few_waves_of_requests():
    w = Workload.parse("1024:128:8")
    assert (w.input_len, w.output_len, w.concurrency) == (1024, 128, 8)
    assert w.prompts(2.0) == 32 and Workload.parse("128:256:1").prompts(2.0) == 16  # 4 waves, at least 16


def test_the_report_puts_each_figure_beside_vllms_with_the_ratio_and_the_roofline():
    w = Workload.parse("128:256:1")
    figures = {key: 10.0 for key, _, _ in METRICS}
    results = {"vllm": {w.name: figures}, "disagg": {w.name: {**figures, "output_throughput": 12.0}},
               "disagg --prefill 0": {}}
    text = report(results, [w], list(results), weights=6e9, bandwidth=3e12)
    assert "2.00 ms a step" in text and "(roofline 500 out tok/s)" in text
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| disagg")}
    assert "| 12.0 (1.20×) | 10.0 (1.00×)" in rows["disagg"] and "(2% of roofline)" in rows["disagg"]
    assert "failed" in rows["disagg --prefill 0"]

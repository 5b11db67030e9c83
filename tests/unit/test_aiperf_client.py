"""benchmarks/aiperf_client.py: the aiperf command the CPU bench runs and the figures it reads from aiperf's JSON
export (tests/data/aiperf_profile_export.json: a real aiperf 0.13.0 export of this workload, trimmed to the fields
the bench reads and a few around them)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.aiperf_client import command, summary

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "aiperf_profile_export.json"


def _export() -> dict:
    return json.loads(SAMPLE.read_text())


def test_summary_reads_throughput_ttft_and_itl_from_a_real_export():
    figures = summary(_export())
    assert figures["completed"] == 4 and figures["failed"] == 0
    assert figures["output_tok_s"] == pytest.approx(11.811, abs=1e-3)
    assert figures["ttft_mean_ms"] == pytest.approx(228.072, abs=1e-3)
    assert figures["ttft_p99_ms"] == pytest.approx(313.696, abs=1e-3)
    assert figures["itl_mean_ms"] == pytest.approx(82.376, abs=1e-3)
    assert figures["itl_p99_ms"] == pytest.approx(95.960, abs=1e-3)


def test_summary_counts_every_failed_request_of_the_error_summary():
    export = _export()
    export["error_summary"] = [{"error_details": {"code": 404, "type": "Not Found", "message": "no model"},
                                "count": 3},
                               {"error_details": {"code": 500, "type": "Internal Server Error", "message": "x"},
                                "count": 2}]
    assert summary(export)["failed"] == 5


def test_a_cancelled_or_incomplete_run_is_an_error_not_figures():
    with pytest.raises(RuntimeError, match="did not complete"):
        summary(_export() | {"was_cancelled": True})
    with pytest.raises(RuntimeError, match="did not complete"):
        summary(_export() | {"is_complete": False})


def test_the_command_asks_for_the_benchs_workload():
    argv = command("/opt/aiperf/bin/aiperf", "http://127.0.0.1:8101", "SmolLM2-135M-Instruct", Path("/models/m"),
                   8, 32, Path("/tmp/a"), temperature=0.0)
    flags = dict(zip(argv[2::], argv[3::]))
    assert argv[:2] == ["/opt/aiperf/bin/aiperf", "profile"] and "--streaming" in argv
    assert flags["--endpoint-type"] == "completions" and flags["--url"] == "http://127.0.0.1:8101"
    assert (flags["--isl"], flags["--isl-stddev"], flags["--osl"], flags["--osl-stddev"]) == ("128", "0", "64", "0")
    assert json.loads(flags["--extra-inputs"]) == {"ignore_eos": True, "temperature": 0.0}
    assert (flags["--concurrency"], flags["--request-count"], flags["--tokenizer"]) == ("8", "32", "/models/m")
    assert flags["--artifact-dir"] == "/tmp/a" and "--no-server-metrics" in argv


def test_extra_flags_follow_the_workload_so_a_paced_loop_can_replace_the_spin():
    argv = command("aiperf", "http://127.0.0.1:8100", "m", Path("/models/m"), 1, 16, Path("/tmp/a"),
                   extra_flags=("--request-rate", "1000", "--arrival-pattern", "constant"))
    assert argv[-4:] == ["--request-rate", "1000", "--arrival-pattern", "constant"]
    assert argv[argv.index("--concurrency") + 1] == "1"  # the concurrency cap stays

"""`disagg bench` against real router, prefill and decode processes serving a tiny model: the shared prefill→decode
`disagg up` (conftest's front_doors)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.front_doors import Cluster
from tests.integration.leaks import assert_no_leaks
from tests.integration.processes import REPO_ROOT, free_port

pytestmark = pytest.mark.parametrize("front_doors", ["prefill-decode"], indirect=True)


def _bench(router: str, tmp_path, *flags: str) -> dict:
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "services", "bench", "--router", router, "--seed", "1",
                           "--json", str(out), "--no-progress", *flags],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Serving Benchmark Result" in done.stdout
    return json.loads(out.read_text())


def test_bench_with_fixed_concurrency_reports_every_request_and_its_full_length(front_doors: Cluster, tmp_path):
    result = _bench(front_doors.router, tmp_path, "--num-prompts", "12", "--input-len", "uniform:8:64",
                    "--output-len", "uniform:4:16", "--max-concurrency", "4", "--warmup", "1",
                    "--goodput-ttft-ms", "60000", "--plot", str(tmp_path / "bench.png"))
    summary, requests = result["summary"], result["requests"]
    assert summary["completed"] == 12 and summary["failed"] == 0
    # ignore_eos: every request generates exactly its max_tokens
    assert [r["output_tokens"] for r in requests] == [r["max_tokens"] for r in requests]
    assert summary["output_tokens"] == sum(r["max_tokens"] for r in requests)
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])  # a 60 s TTFT limit admits all
    assert 0 < summary["ttft"]["p50"] <= summary["ttft"]["p99"] <= summary["e2e"]["p99"]
    assert summary["itl"]["count"] == sum(len(r["itl_ms"]) for r in requests) > 0
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert_no_leaks(front_doors.workers)


def test_bench_with_poisson_arrivals_and_normal_lengths(front_doors: Cluster, tmp_path):
    result = _bench(front_doors.router, tmp_path, "--num-prompts", "8", "--input-len", "normal:32:8",
                    "--output-len", "fixed:6", "--request-rate", "20", "--warmup", "0")
    assert result["summary"]["completed"] == 8
    assert all(r["output_tokens"] == 6 for r in result["requests"])
    assert result["config"]["request_rate"] == 20


def test_bench_spread_over_client_processes_sends_the_same_workload_on_the_same_schedule(front_doors: Cluster,
                                                                                        tmp_path):
    flags = ("--num-prompts", "8", "--input-len", "normal:32:8", "--output-len", "fixed:6", "--request-rate", "10",
             "--warmup", "0")
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = _bench(front_doors.router, tmp_path / "one", *flags)
    two = _bench(front_doors.router, tmp_path / "two", *flags, "--clients", "2")
    assert two["summary"]["completed"] == 8 and two["summary"]["failed"] == 0
    for field in ("prompt_tokens", "max_tokens", "output_tokens"):
        assert [r[field] for r in two["requests"]] == [r[field] for r in one["requests"]], field
    # Both follow one Poisson schedule (the seed's): each request is sent at the same offset, within a loop's lag.
    assert all(abs(a["sent_s"] - b["sent_s"]) < 0.15 for a, b in zip(one["requests"], two["requests"]))
    assert max(r["sent_s"] for r in one["requests"]) > 0.3  # the seed's schedule spreads the sends
    # each sending loop's busy share: one from the single client, one from each process of the spread
    assert len(one["summary"]["client_loop_busy"]) == 1 and len(two["summary"]["client_loop_busy"]) == 2
    assert all(0 <= busy < 1.5 for busy in one["summary"]["client_loop_busy"] + two["summary"]["client_loop_busy"])
    assert_no_leaks(front_doors.workers)


def test_bench_drives_every_front_door_with_the_same_workload_and_compares_them(front_doors: Cluster,
                                                                               front_door_model, tmp_path):
    done = subprocess.run([sys.executable, "-m", "services", "bench", "--router", front_doors.router, "--http",
                           front_doors.http, "--api", "grpc,openai,kserve", "--tokenizer", front_door_model,
                           "--num-prompts", "6", "--input-len", "uniform:8:32", "--output-len", "uniform:4:8",
                           "--max-concurrency", "3", "--warmup", "0", "--seed", "2",
                           "--json", str(tmp_path / "bench.json"), "--no-progress"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()
            if line.split() and line.split()[0] in ("grpc", "openai", "kserve")}
    assert set(rows) == {"grpc", "openai", "kserve"} and rows["grpc"][-1] == "1.000x"
    per_api = {api: json.loads((tmp_path / f"bench-{api}.json").read_text()) for api in rows}
    lengths = {api: [r["max_tokens"] for r in result["requests"]] for api, result in per_api.items()}
    assert lengths["grpc"] == lengths["openai"] == lengths["kserve"]  # the same work through each door
    for api, result in per_api.items():  # every request complete, to its full length (ignore_eos)
        assert result["summary"]["completed"] == 6 and result["summary"]["failed"] == 0, api
        assert [r["output_tokens"] for r in result["requests"]] == lengths[api], api
        assert all(r["ttft_ms"] > 0 for r in result["requests"]), api
    assert_no_leaks(front_doors.workers)


def test_bench_openai_alone_needs_only_the_http_server(front_doors: Cluster, tmp_path):
    """`--api openai` alone lists the models over HTTP (GET /v1/models), so it drives any OpenAI-compatible server
    (vLLM's in benchmarks/vllm_cpu.py): here --router points nowhere."""
    result = _bench(f"127.0.0.1:{free_port()}", tmp_path, "--api", "openai", "--http", front_doors.http,
                    "--num-prompts", "4", "--input-len", "fixed:16", "--output-len", "fixed:4", "--warmup", "0")
    assert result["summary"]["completed"] == 4 and all(r["output_tokens"] == 4 for r in result["requests"])
    assert result["config"]["model"] == "tiny-text"  # the router's model, as its /v1/models names it

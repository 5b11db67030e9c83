"""The planner as a user runs it: `disagg plan` profiles the tiny model with the real engine and caches it, and
`disagg up --planner` moves a CPU worker between roles under traffic with no request failed."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from services.planner.layouts import load_plan
from tests.integration.processes import REPO_ROOT
from tests.integration.test_router import make_text_model
from tests.integration.test_up import Up

GRID = "lengths=16,64;batches=1,2;decode_batches=1,2;contexts=16,64;decode_steps=6;repeats=1"


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> str:
    return str(make_text_model(tmp_path_factory.mktemp("models") / "tiny-text"))


def test_plan_profiles_once_then_ranks_from_the_cache_and_saves_the_best(text_model, tmp_path):
    env = {**os.environ, "DISAGG_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "services", "plan", "--model", text_model, "--workload",
               "in=16-96,out=16,rate=2", "--slo", "ttft_p90=2s,itl_p99=1s", "--profile-grid", GRID,
               "--plan-requests", "100", "--save", str(tmp_path / "plan.json"), "--json", str(tmp_path / "all.json")]
    first = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "profiling cores=1" in first.stderr and re.search(r"prefill 2 x 64 tokens: [\d.]+ ms", first.stderr)
    assert re.search(r"decode 2 rows at context 64: [\d.]+ ms a step", first.stderr)
    assert re.search(r"handoff of 64 tokens' KV: [\d.]+ ms", first.stderr), first.stderr
    assert "1 x aggregated" in first.stdout and "1P1D" in first.stdout, first.stdout
    ranking = json.loads((tmp_path / "all.json").read_text())["ranking"]
    layout = load_plan(str(tmp_path / "plan.json"))
    assert layout.describe() == ranking[0]["layout"] and ranking[0]["goodput_rps"] > 0
    assert f"disagg up {' '.join(layout.up_flags())}" in first.stdout
    second = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "from the cache" in second.stderr and "profiling" not in second.stderr
    assert json.loads((tmp_path / "all.json").read_text())["ranking"] == ranking  # the same seed, the same figures


def test_up_planner_moves_a_worker_to_prefill_under_traffic_with_no_request_failed(text_model, tmp_path):
    """Two aggregated workers and an SLO whose TTFT no layout meets but whose ITL is loose: prefill is the pressed
    role, so after two windows the planner drains decode-1 and starts a prefill worker on its slot; the router takes
    the new worker's prompts while the bench runs on, and no request fails."""
    up = Up("--model", text_model, "--router-port", "0", "--prefill", "0", "--decode", "2", "--max-num-seqs", "8",
            "--planner", "--slo", "ttft_p90=1ms,itl_p99=60s", "--planner-interval", "1.5", "--planner-windows", "2",
            "--planner-cooldown", "0")
    bench_out = tmp_path / "bench.json"
    try:
        router = up.wait()
        bench = subprocess.Popen([sys.executable, "-m", "services", "bench", "--router", router, "--num-prompts", "90",
                                  "--input-len", "uniform:16:120", "--output-len", "12", "--request-rate", "6",
                                  "--no-progress", "--timeout", "60", "--json", str(bench_out)], cwd=REPO_ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.extend(bench.stdout), daemon=True)
        reader.start()
        moved = up.wait_line("in place of decode-1", 60)
        assert re.search(r"prefill-0 serving on \S+ in place of decode-1 \(drained in [\d.]+s", moved), moved
        assert bench.wait(120) == 0, "".join(output)
        reader.join(5)
        summary = json.loads(bench_out.read_text())["summary"]
        assert summary["failed"] == 0 and summary["completed"] == 90, summary
        decision = up.wait_line("planner: moving decode-1 to prefill", 1)
        assert re.search(r"pressure prefill [\d.]+x, decode [\d.]+x of the SLO, 2 windows in a row", decision)
        assert any("move a decode worker to prefill" in line and "ttft_p90" in line for line in up.lines)
        assert not any("decode-1 exited" in line or "restarting it" in line for line in up.lines), "".join(up.lines)
        # The new prefill worker takes prompts: a few more after the bench, again until one prefilled remotely (on a
        # loaded machine its start, and the router finding it, can take longer than the bench's 15 s and one round).
        deadline = time.monotonic() + 90
        while True:
            after = subprocess.run([sys.executable, "-m", "services", "bench", "--router", router, "--num-prompts",
                                    "6", "--input-len", "64", "--output-len", "4", "--no-progress", "--timeout", "60"],
                                   cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
            assert after.returncode == 0, after.stdout + after.stderr
            metrics = urllib.request.urlopen(up.metrics_urls()["router"], timeout=10).read().decode()
            remote = re.search(r'disagg_routing_prefill_decisions_total\{[^}]*where="remote"[^}]*\} (\d+)', metrics)
            if (remote and int(remote.group(1)) > 0) or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert remote and int(remote.group(1)) > 0, metrics
    finally:
        assert up.stop() == 0, "".join(up.lines)

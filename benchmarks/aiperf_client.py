"""Drive an OpenAI-compatible server with aiperf (NVIDIA's benchmark client) and read its JSON export.

aiperf lives in a venv of its own (its pins are not ours):

    python3 -m venv /opt/aiperf && /opt/aiperf/bin/pip install aiperf

The workload is benchmarks.vllm_cpu's: completions, streaming, synthetic prompts of 128 tokens (the model's own
tokenizer counts them), 64 output tokens with ignore_eos, a fixed seed. aiperf counts output tokens by tokenizing
the text it got back, so a reply of 64 tokens can count as 62 or 63 where a decode joins two tokens' text.

With --concurrency alone, aiperf 0.13's timing manager spins while every slot is taken (RequestRateStrategy retries
`try_issue_credit` after a bare yield to its event loop): most of a core for the whole run, on the cores the server
uses. `extra_flags` passes flags through, e.g. `--request-rate 1000 --arrival-pattern constant`, under which the
same loop waits on a 1 ms pacer between tries (docs/benchmarks/vllm_cpu.md has both measured).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from pathlib import Path

DEFAULT_BIN = "/opt/aiperf/bin/aiperf"
INSTALL = "python3 -m venv /opt/aiperf && /opt/aiperf/bin/pip install aiperf"
EXPORT = "profile_export_aiperf.json"


def command(aiperf: str, url: str, model_name: str, tokenizer: Path, concurrency: int, prompts: int,
            artifacts: Path, temperature: float = 0.0, warmup: int = 2, seed: int = 35,
            extra_flags: tuple[str, ...] = ()) -> list[str]:
    extra = {"ignore_eos": True, "temperature": temperature}
    # no /metrics scrapes and no GPU probes: on a shared CPU they would cost the server under test cycles
    return [aiperf, "profile", "--model", model_name, "--url", url, "--endpoint-type", "completions", "--streaming",
            "--isl", "128", "--isl-stddev", "0", "--osl", "64", "--osl-stddev", "0",
            "--extra-inputs", json.dumps(extra), "--tokenizer", str(tokenizer),
            "--concurrency", str(concurrency), "--request-count", str(prompts),
            "--warmup-request-count", str(warmup), "--random-seed", str(seed),
            "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
            "--export-level", "summary", "--artifact-dir", str(artifacts), *extra_flags]


def summary(export: dict) -> dict:
    """The bench's figures from aiperf's profile_export_aiperf.json (milliseconds, tokens a second)."""
    if export.get("was_cancelled") or not export.get("is_complete", True):
        raise RuntimeError("aiperf's run did not complete (was_cancelled or not is_complete)")
    ttft, itl = export["time_to_first_token"], export["inter_token_latency"]
    return {"completed": int(export["request_count"]["avg"]),
            "failed": sum(error["count"] for error in export.get("error_summary", [])),
            "output_tok_s": export["output_token_throughput"]["avg"],
            "ttft_mean_ms": ttft["avg"], "ttft_p99_ms": ttft["p99"],
            "itl_mean_ms": itl["avg"], "itl_p99_ms": itl["p99"]}


def run(aiperf: str, url: str, model_name: str, tokenizer: Path, concurrency: int, prompts: int, out: Path,
        temperature: float = 0.0, extra_flags: tuple[str, ...] = ()) -> dict:
    """One aiperf profile; its summary with the CPU seconds aiperf's processes took and the wall seconds it ran."""
    artifacts = out / f"aiperf-{url.rsplit(':', 1)[-1]}-c{concurrency}-{time.monotonic_ns()}"
    log = artifacts.with_suffix(".log")
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    # our imports set HF_HUB_OFFLINE=1, under which aiperf 0.13 takes a local tokenizer directory for a hub id
    # and fails ("Repo id must be in the form 'repo_name'"); a directory needs no hub either way
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    with log.open("w") as sink:
        argv = command(aiperf, url, model_name, tokenizer, concurrency, prompts, artifacts, temperature,
                       extra_flags=extra_flags)
        done = subprocess.run(argv, stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=900)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"aiperf exited with {done.returncode}; see {log}:\n"
                           + "".join(log.read_text().splitlines(True)[-40:]))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # aiperf reaps its services, so theirs count here too
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return summary(json.loads((artifacts / EXPORT).read_text())) | {"client_cpu_s": cpu, "client_wall_s": wall}

"""Where the decode worker's step period goes when served, beside the forward (issue #35).

    python -m benchmarks.decode_period [--concurrency 1] [--num-prompts 16] [--ours-args "--prefill 0"]

Starts `disagg up --dtype bfloat16` as benchmarks.vllm_cpu does, sends `disagg bench`'s streaming completions (128
prompt tokens, 64 output, ignore_eos) at --concurrency, and prints:
- the decode worker's decode steps over the run, from its /metrics scraped before and after it (disagg_engine_step_*):
  the period (start to start while the engine stayed busy; a mean ITL is its mean, token transport being pipelined)
  = the step's CPU time on the engine thread + waiting (the rest of the step's wall time: for a core or the GIL) + the
  gap between steps (the loop's own work), with the rows a step ran on average (medians from the histograms'
  buckets). A metric holds no single step: the run's steps are not told apart by batch size, and a step's own wait
  for a core (its run_delay in /proc schedstat) is not split out of waiting; the engine thread's wait for a core over
  the run is in the thread table below.
- every thread of every process `up` started: CPU ms and context switches per output token over the run, its run-queue
  wait, and the cores it was seen running on (sampled every 10 ms).
Compare the step's CPU time with the in-process step of `python -m benchmarks.cpu_step` run just before or after:
this machine's load moves both by up to a fifth.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.processes import REPO_ROOT, free_port  # noqa: E402
from benchmarks.scrape import scrape_url  # noqa: E402
from benchmarks.step_metrics import CPU, PERIOD, SEQUENCES, STEP, buckets, quantile, total, window  # noqa: E402
from benchmarks.vllm_cpu import Server  # noqa: E402


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def children(pid: int) -> dict[int, str]:
    """The processes `up` started: pid -> module (`services.decode`, ...)."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(_read(f"/proc/{entry}/stat").rsplit(")", 1)[1].split()[1]) == pid:
                argv = _read(f"/proc/{entry}/cmdline").split("\0")
                found[int(entry)] = argv[argv.index("-m") + 1] if "-m" in argv else argv[0]
        except (OSError, ValueError, IndexError):
            pass
    return found


def thread_stats(pid: int) -> dict[int, dict]:
    stats = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            run_ns, delay_ns, _ = map(int, _read(f"{base}/schedstat").split())
            status = dict(line.split(":\t", 1) for line in _read(f"{base}/status").splitlines() if ":\t" in line)
            stats[int(tid)] = {"name": _read(f"{base}/comm").strip(), "cpu_ms": run_ns / 1e6,
                               "delay_ms": delay_ns / 1e6,
                               "voluntary": int(status["voluntary_ctxt_switches"]),
                               "involuntary": int(status["nonvoluntary_ctxt_switches"]),
                               "cores": status["Cpus_allowed_list"].strip()}
        except (OSError, KeyError, ValueError):
            pass
    return stats


class CoreSampler(threading.Thread):
    """Every 10 ms: which core each running thread of `pids` is on."""

    def __init__(self, pids: list[int]):
        super().__init__(daemon=True)
        self.pids, self.seen, self.stop = pids, collections.Counter(), threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.01):
            for pid in self.pids:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    try:
                        fields = _read(f"/proc/{pid}/task/{tid}/stat").rsplit(")", 1)[1].split()
                    except OSError:
                        continue
                    if fields[0] == "R":
                        self.seen[int(tid), int(fields[36])] += 1


def bench(url: str, concurrency: int, prompts: int, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "services", "bench", "--api", "openai", "--http", url,
                    "--num-prompts", str(prompts), "--input-len", "fixed:128", "--output-len", "fixed:64",
                    "--max-concurrency", str(concurrency), "--warmup", "0", "--seed", "35", "--no-progress",
                    "--json", str(out)], cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL, timeout=900)
    return json.loads(out.read_text())["summary"]


def metrics_url(pid: int) -> str:
    """A child's /metrics, from the --metrics-port `up` gave it (with --metrics-port-base, the port itself)."""
    argv = _read(f"/proc/{pid}/cmdline").split("\0")
    return f"http://127.0.0.1:{argv[argv.index('--metrics-port') + 1]}/metrics"


def period_report(delta: dict[str, float]) -> str:
    """The decode steps of one run (step_metrics.window of the decode worker's scrapes), mean and median (ms)."""
    steps, periods = total(delta, STEP + "_count", kind="decode"), buckets(delta, PERIOD, kind="decode")
    count = periods[-1][1] if periods else 0.0
    if not steps or not count:
        return "decode steps: none"
    wall, cpu = total(delta, STEP + "_sum", kind="decode") / steps, total(delta, CPU, kind="decode") / steps
    period = total(delta, PERIOD + "_sum", kind="decode") / count
    median = quantile(periods, 0.5)
    lines = [f"decode steps: {steps:.0f}, {total(delta, SEQUENCES, kind='decode') / steps:.1f} sequences a step "
             "on average",
             f"  {'period':<20} median {median * 1e3:6.2f}  mean {period * 1e3:6.2f} ms",
             f"  {'step wall':<20} median {quantile(buckets(delta, STEP, kind='decode'), 0.5) * 1e3:6.2f}  "
             f"mean {wall * 1e3:6.2f} ms"]
    for name, value in (("step CPU", cpu), ("waiting (core, GIL)", wall - cpu), ("gap between steps", period - wall)):
        lines.append(f"  {name:<20} {'':13} mean {value * 1e3:6.2f} ms")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--ours-args", default="", help="`disagg up` flags beside the defaults")
    p.add_argument("--port", type=int, default=8111)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="decode-period-") as tmp:
        up = [sys.executable, "-m", "services", "up", "--http-port", str(args.port), "--router-port", "0",
              "--metrics-port-base", str(free_port()), "--dtype", "bfloat16", *args.ours_args.split()]
        server = Server("disagg", up, {}, args.port)
        try:
            server.start(Path(tmp), 300)
            procs = children(server.process.pid)
            decode = metrics_url(next(pid for pid, module in procs.items() if module == "services.decode"))
            bench(server.url, 1, 2, Path(tmp) / "warmup.json")
            before = {pid: thread_stats(pid) for pid in procs}
            steps_before = scrape_url(decode)
            sampler = CoreSampler(list(procs))
            sampler.start()
            summary = bench(server.url, args.concurrency, args.num_prompts, Path(tmp) / "run.json")
            sampler.stop.set()
            after = {pid: thread_stats(pid) for pid in procs}
            steps = window([scrape_url(decode)], [steps_before])
        finally:
            server.stop()
    tokens = summary["output_tokens"]
    print(f"concurrency {args.concurrency}: out tok/s {summary['output_throughput']:.1f}, TTFT mean "
          f"{summary['ttft']['mean']:.1f} ms, ITL mean {summary['itl']['mean']:.2f} ms, load {os.getloadavg()[0]:.2f}")
    print(period_report(steps))
    print(f"threads (per output token, {tokens} tokens):")
    for pid, module in procs.items():
        print(f"  {module} ({pid})")
        for tid, now in after[pid].items():
            was = before[pid].get(tid, {"cpu_ms": 0, "delay_ms": 0, "voluntary": 0, "involuntary": 0})
            cpu = (now["cpu_ms"] - was["cpu_ms"]) / tokens
            if cpu < 0.01:
                continue
            seen = {core: n for (t, core), n in sorted(sampler.seen.items()) if t == tid}
            print(f"    {now['name']:<16} on {now['cores']:<5} CPU {cpu:6.3f} ms, waiting for a core "
                  f"{(now['delay_ms'] - was['delay_ms']) / tokens:6.3f} ms, switches "
                  f"{(now['voluntary'] - was['voluntary']) / tokens:4.2f} voluntary "
                  f"{(now['involuntary'] - was['involuntary']) / tokens:4.2f} involuntary; seen on cores {seen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

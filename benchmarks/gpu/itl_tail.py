"""Where a served workload's inter-token gaps come from: each `disagg up` configuration, one after the other, driven by
`disagg bench` through the OpenAI door, with the decode worker's engine steps beside the client's gaps.

    python -m benchmarks.gpu.itl_tail MODEL_DIR IN:OUT:CONCURRENCY:PROMPTS [--up-args="FLAGS" ...] [--device cuda]
        [--load-format dummy] [--out DIR]

Each --up-args (default one: "", the defaults) is one `disagg up --device DEVICE --model MODEL_DIR` with those flags
beside them. Printed per configuration: the bench's summary; from every worker's /metrics scraped before and
after the run, its steps by kind (decode, mixed: a prompt chunk beside decode rows, prefill) with their wall-time
quantiles and mean rows, and the router's prefill placements; the client's gaps (p50, p99, how many pass 20, 40 and
80 ms) and the steps that stalled several streams at once (gaps over twice the median ending within 5 ms of each
other), each with how many requests were sent in the 300 ms before it. The bench's per-request JSON goes to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.scrape import scrape_url  # noqa: E402
from benchmarks.step_metrics import buckets, quantile, total  # noqa: E402
from benchmarks.vllm_cpu import Server  # noqa: E402

HTTP_PORT = 8301
METRICS_BASE = 18600
STEP = "disagg_engine_step_seconds"


def scrape_all(ports: range) -> dict[int, dict[str, float]]:
    found = {}
    for port in ports:
        try:
            found[port] = scrape_url(f"http://127.0.0.1:{port}/metrics")
        except OSError:
            pass  # no service on it
    return found


def steps_report(after: dict[int, dict[str, float]], before: dict[int, dict[str, float]]) -> list[str]:
    lines = []
    for port, now in after.items():
        delta = {key: value - before.get(port, {}).get(key, 0.0) for key, value in now.items()}
        if any(key.startswith(STEP + "_count") and value > 0 for key, value in delta.items()):
            lines.append(f"  port {port} steps:")
            for kind in ("decode", "mixed", "prefill"):
                b = buckets(delta, STEP, kind=kind)
                count = b[-1][1] if b else 0
                if count:
                    rows = total(delta, "disagg_engine_step_sequences_total", kind=kind) / count
                    lines.append(f"    {kind}: {count:.0f} steps, p50 {quantile(b, .5) * 1e3:.1f} p90 "
                                 f"{quantile(b, .9) * 1e3:.1f} p99 {quantile(b, .99) * 1e3:.1f} ms, rows mean {rows:.1f}")
        lines += [f"  port {port} {key} {value:.0f}" for key, value in sorted(delta.items())
                  if "decision" in key and value]
    return lines


def gaps_report(bench_json: Path) -> list[str]:
    requests = json.loads(bench_json.read_text())["requests"]
    gaps = []  # (arrival ms since the first send, gap ms)
    for r in requests:
        if r["ttft_ms"] is None:
            continue
        at = r["sent_s"] * 1e3 + r["ttft_ms"]
        for gap in r["itl_ms"]:
            at += gap
            gaps.append((at, gap))
    values = sorted(g for _, g in gaps)
    median = statistics.median(values)
    lines = [f"  gaps {len(values)}: p50 {median:.1f} p99 {values[int(0.99 * len(values))]:.1f} max {values[-1]:.1f}; "
             f">20ms {sum(g > 20 for g in values)}, >40 {sum(g > 40 for g in values)}, >80 {sum(g > 80 for g in values)}"]
    sends = [r["sent_s"] * 1e3 for r in requests]
    stalls: list[list[float]] = []  # [end ms, streams stalled]
    for at in sorted(t for t, g in gaps if g > 2 * median):
        if not stalls or at - stalls[-1][0] > 5:
            stalls.append([at, 0])
        stalls[-1][1] += 1
    lines.append(f"  {len(stalls)} stalled steps; the first 25 (end ms, streams stalled, sends in the 300 ms before):")
    lines.append("    " + str([(round(t), n, sum(t - 300 < s < t for s in sends)) for t, n in stalls[:25]]))
    return lines


def run_config(index: int, flags: str, args: argparse.Namespace, logs: Path) -> None:
    up = [sys.executable, "-m", "services", "up", "--device", args.device, "--model", args.model, "--load-format",
          args.load_format, "--http-port", str(HTTP_PORT), "--router-port", "0", "--metrics-port-base",
          str(METRICS_BASE), *flags.split()]
    server = Server(f"config{index}", up, {}, HTTP_PORT)
    ready = server.start(logs, 600)
    print(f"=== config {flags!r}: ready after {ready:.0f}s", flush=True)
    try:
        print("\n".join("  | " + line for line in server.log.read_text().splitlines()[-25:]))
        bench = [sys.executable, "-m", "services", "bench", "--api", "openai", "--http", server.url, "--tokenizer",
                 args.model, "--no-progress"]
        subprocess.run([*bench, "--num-prompts", "8", "--max-concurrency", "4", "--input-len", "fixed:128",
                        "--output-len", "fixed:16"], capture_output=True, check=True)  # warm-up, not counted
        ports = range(METRICS_BASE, METRICS_BASE + 6)
        before = scrape_all(ports)
        out = args.out / f"bench{index}.json"
        done = subprocess.run([*bench, "--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency),
                               "--input-len", f"fixed:{args.input_len}", "--output-len", f"fixed:{args.output_len}",
                               "--json", str(out)], capture_output=True, text=True, check=True)
        print(done.stdout[-2500:])
        print("\n".join(steps_report(scrape_all(ports), before) + gaps_report(out)), flush=True)
    finally:
        server.stop()
        time.sleep(3)  # its ports and GPU memory released before the next one starts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("workload", help="IN:OUT:CONCURRENCY:PROMPTS")
    p.add_argument("--up-args", action="append", default=None, help="`disagg up` flags of one configuration")
    p.add_argument("--device", default="cuda")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()))
    args = p.parse_args()
    args.input_len, args.output_len, args.concurrency, args.prompts = (int(x) for x in args.workload.split(":"))
    logs = Path(tempfile.mkdtemp(prefix="itl-tail-"))
    for index, flags in enumerate(args.up_args or [""]):
        run_config(index, flags, args, logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

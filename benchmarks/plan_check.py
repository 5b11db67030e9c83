"""The planner against reality: `disagg plan`'s top layouts started with `disagg up`, each driven by `disagg bench` at
rates around its predicted goodput, and the goodput measured against the predicted one.

    python -m benchmarks.plan_check --workload "in=64-512,out=32,rate=2" --slo ttft_p90=2s,itl_p99=200ms \\
        [--top 3] [--ladder 0.5,0.75,1,1.25] [--num-prompts 60] [--json out.json] [engine flags: --model, --device ...]

For each layout: one `disagg up` with the layout's flags (and the engine flags given here, which the profile was
taken with), then a bench at each ladder rate (a factor of the layout's predicted goodput: Poisson arrivals, the
workload's lengths, --seed; enough requests for --duration seconds of arrivals). A rate is met when no request
failed, the layout kept up (the predictor's backlog test on the measured latencies) and every SLO term holds over
the measured requests (TTFT and end-to-end per request, ITL over every gap, as the predictor counts them); the
measured goodput
is the highest met rate of the ladder (0 if none), so it is known to the ladder's resolution. Printed per layout:
predicted and measured goodput and their ratio, and at each rate the predicted and measured figures.
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.cli import plan as plan_cli  # noqa: E402
from services.planner.layouts import Layout  # noqa: E402
from services.planner.predict import MAX_BACKLOG_GROWTH, Predictor  # noqa: E402
from services.planner.workload import Slo, Workload, parse_slo, parse_workload  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def measured_figures(bench: dict, slo: Slo) -> dict[str, float]:
    """Each SLO term's figure (seconds) over a `disagg bench --json` file's requests, counted as the predictor
    counts them, and the bench's failed count."""
    done = [r for r in bench["requests"] if r["error"] is None and r["ttft_ms"] is not None]
    ttft = np.array([r["ttft_ms"] for r in done]) / 1e3
    e2e = np.array([r["e2e_ms"] for r in done]) / 1e3
    gaps = np.array([g for r in done for g in r["itl_ms"]]) / 1e3
    out = {"failed": float(bench["summary"]["failed"]), "backlog_growth": backlog_growth(done)}
    for term in slo.terms:
        values = {"ttft": ttft, "e2e": e2e, "itl": gaps}[term.metric]
        out[term.name] = float(np.percentile(values, term.quantile)) if len(values) else float("inf")
    return out


def backlog_growth(done: list[dict]) -> float:
    """The predictor's overload test on measured requests: the mean end-to-end latency of the last quarter sent over
    the second quarter's (SimResult.backlog_growth)."""
    e2e = [r["e2e_ms"] for r in sorted(done, key=lambda r: r["sent_s"] or 0.0)]
    quarter = max(1, len(e2e) // 4)
    second = float(np.mean(e2e[quarter:2 * quarter] or e2e)) if e2e else 0.0
    return float(np.mean(e2e[-quarter:])) / second if second > 0 else 1.0


def meets(figures: dict[str, float], slo: Slo) -> bool:
    return (figures["failed"] == 0 and figures["backlog_growth"] <= MAX_BACKLOG_GROWTH
            and all(figures[t.name] <= t.limit_s for t in slo.terms))


def measured_goodput(points: list[tuple[float, bool]]) -> float:
    """The highest rate of the ladder that met the SLO (0: none did)."""
    return max((rate for rate, ok in points if ok), default=0.0)


class UpProcess:
    """One `disagg up` for a layout; its output is kept, its router address read from the banner."""

    def __init__(self, flags: list[str]):
        self.popen = subprocess.Popen([sys.executable, "-m", "services", "up", "--router-port", "0", "--http-port",
                                       "0", *flags], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True)
        self.lines: list[str] = []
        self.router: str | None = None
        self.up = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line)
            if line.startswith("disagg is up: router on "):
                self.router = line.split()[5]
                self.up.set()
        self.up.set()

    def wait(self, timeout_s: float) -> str:
        if not self.up.wait(timeout_s) or self.router is None:
            raise RuntimeError("disagg up did not come up:\n" + "".join(self.lines[-30:]))
        return self.router

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def bench(router: str, workload: Workload, rate: float, args: argparse.Namespace, out: Path) -> dict:
    prompts = min(args.max_prompts, max(args.num_prompts, int(rate * args.duration) + 1))  # a run spans --duration
    command = [sys.executable, "-m", "services", "bench", "--router", router, "--num-prompts", str(prompts),
               "--input-len", str(workload.prompt), "--output-len", str(workload.output), "--request-rate",
               f"{rate:.4f}", "--seed", str(args.seed), "--no-progress", "--timeout", "300", "--json", str(out)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if not out.is_file():
        raise RuntimeError(f"disagg bench wrote nothing: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(out.read_text())


def check_layout(layout: Layout, predicted: float, predictor: Predictor, args: argparse.Namespace,
                 engine_flags: list[str], scratch: Path) -> dict:
    workload, slo = predictor.workload, predictor.slo
    base = predicted or workload.rate or 1.0
    up = UpProcess([*layout.up_flags(), *engine_flags])
    points = []
    try:
        router = up.wait(args.start_timeout)
        for factor in args.ladder:
            rate = base * factor
            figures = measured_figures(bench(router, workload, rate, args, scratch / f"{len(points)}.json"), slo)
            expected = predictor.at(layout, rate)
            points.append({"rate": rate, "measured": figures, "met": meets(figures, slo),
                           "predicted": {t.name: expected.values[t.name] for t in slo.terms},
                           "predicted_met": expected.meets})
            print(f"  {layout.describe()} at {rate:.3f} req/s: " + ", ".join(
                f"{t.name} {expected.values[t.name] * 1e3:.0f} predicted / {figures[t.name] * 1e3:.0f} ms measured"
                for t in slo.terms) + f", failed {figures['failed']:.0f}: {'met' if points[-1]['met'] else 'not met'}",
                flush=True)
    finally:
        up.stop()
    measured = measured_goodput([(p["rate"], p["met"]) for p in points])
    return {"layout": layout.describe(), "up_flags": layout.up_flags(), "predicted_goodput_rps": predicted,
            "measured_goodput_rps": measured, "ratio": measured / predicted if predicted else None, "points": points}


def report(results: list[dict]) -> str:
    lines = ["| layout | predicted goodput req/s | measured (ladder) req/s | measured / predicted |", "|---|---|---|---|"]
    for r in results:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        lines.append(f"| {r['layout']} | {r['predicted_goodput_rps']:.3f} | {r['measured_goodput_rps']:.3f} | "
                     f"{ratio} |")
    return "\n".join(lines)


# `disagg plan`'s own flags (each with its value): up would plan by them again, where the layout's flags choose here.
_PLANNING_FLAGS = ("--workload", "--slo", "--profile-grid", "--plan-requests", "--plan-seed", "--plan-tp-sizes",
                   "--gpus")


def up_engine_flags(rest: list[str]) -> list[str]:
    """The flags given here that every `disagg up` gets: the engine flags, without the planning ones."""
    out, skip = [], False
    for arg in rest:
        if skip:
            skip = False
        elif arg in _PLANNING_FLAGS:
            skip = True
        elif arg != "--reprofile" and arg.split("=", 1)[0] not in _PLANNING_FLAGS:
            out.append(arg)
    return out


def _ladder(text: str) -> list[float]:
    return sorted(float(f) for f in text.split(",") if f.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--ladder", type=_ladder, default=_ladder("0.5,0.75,1,1.25"))
    parser.add_argument("--num-prompts", type=int, default=60, help="requests a rate at least")
    parser.add_argument("--duration", type=float, default=30.0,
                        help="seconds of arrivals a rate at least (more requests at higher rates)")
    parser.add_argument("--max-prompts", type=int, default=3000, help="requests a rate at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, default=None)
    own, rest = parser.parse_known_args(argv)
    args = plan_cli._parser().parse_args(rest)  # the planning and engine flags, as `disagg plan` takes them
    for key, value in vars(own).items():
        setattr(args, key, value)
    engine_flags = up_engine_flags(rest)
    ranking, profile = plan_cli.rank(args, lambda m: print(m, file=sys.stderr, flush=True))
    workload, slo = parse_workload(args.workload), parse_slo(args.slo)
    predictor = Predictor(profile, workload, slo, args.plan_requests, args.plan_seed)
    started = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        results = [check_layout(p.layout, p.goodput, predictor, args, engine_flags, Path(scratch))
                   for p in ranking[:args.top]]
    print(f"\nworkload {workload.describe()}; SLO {slo.describe()}; profile {profile.key} ({profile.device})")
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps({"workload": workload.to_dict(), "slo": slo.describe(), "profile": profile.key,
                                         "device": profile.device, "started_at_unix": started, "results": results},
                                        indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""When disaggregation pays on one GPU: input length × output length × {aggregated, every prefill remote, conditional}.

    python -m benchmarks.disagg_sweep --tokenizer-from DIR [--shape llama-3.2-3b] [--inputs 128,512,2048,8192]
        [--outputs 32,256] [--num-prompts 32] [--concurrency 8] [--threshold T] [--out DIR]

Saves a random bf16 model of the shape (with DIR's tokenizer files), starts one prefill and one decode worker on
the GPU and three routers over them: `aggregated` (the decode worker alone), `remote` (every prefill on the
prefill worker) and `conditional` (--max-local-prefill-tokens T: prompts of at most T tokens prefill on the decode
worker). Through each router it first runs a few requests of every input length untimed (Triton compiles a
kernel at its first use of a shape), then for each (input, output) cell `disagg bench` (fixed lengths,
--concurrency requests in flight, the same seed): `aggregated` and `remote` first, then `conditional`, with T
the crossover those two measured (disagg_sweep_plot.crossover: the prompt length from which `remote` meets
issue #24's targets against `aggregated`: ≥ 0.9× output tok/s, TTFT mean ≤ 1.5×, ITL p99 ≥ 2× better), or each
T of --threshold. An input may be a distribution (uniform:512:2048). Each
run records output tok/s, TTFT mean/p90, ITL p99, the router's TTFT breakdown and decode's mean KV pull (its
own disagg_kv_pull_seconds); all of it lands in OUT/sweep.json as it is measured, then OUT/sweep.md (the
table) and OUT/sweep.png (the plot; benchmarks/disagg_sweep_plot.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.disagg_sweep_plot import crossover, plot, table  # noqa: E402
from benchmarks.gpu_engine_vs_hf import SHAPES  # noqa: E402
from benchmarks.gpu_kv_plane import model_dir  # noqa: E402
from benchmarks.scrape import scrape  # noqa: E402
from benchmarks.processes import REPO_ROOT, ServiceProcess, start_services  # noqa: E402

MODES = ("aggregated", "remote", "conditional")


def engine_args(model: Path, args: argparse.Namespace) -> tuple[str, ...]:
    longest = max(_longest(spec) for spec in args.inputs) + max(args.outputs)
    return ("--model", str(model), "--device", "cuda", "--dtype", "bfloat16", "--num-kv-blocks", str(args.kv_blocks),
            "--max-model-len", str(longest + 64), "--no-prefix-caching", "--session-ttl", "120")


def _longest(spec: str) -> int:
    return int(spec.rsplit(":", 1)[-1])


def start_router(model: Path, workers: list[ServiceProcess], mode: str, threshold: int) -> ServiceProcess:
    prefill, decode = workers
    flags = ["--model", str(model), "--decode-workers", decode.address, "--http-port", "0"]
    if mode != "aggregated":
        flags += ["--prefill-workers", prefill.address, "--max-local-prefill-tokens",
                  str(threshold if mode == "conditional" else 0)]
    return start_services([("router", tuple(flags))])[0]


def pull_totals(decode: ServiceProcess) -> tuple[float, float]:
    """(seconds, count) of every KV pull decode has made, over all backends."""
    return pull_sums(scrape(decode))


def pull_sums(samples: dict[str, float]) -> tuple[float, float]:
    """(seconds, count) of the KV pulls in one scrape of a decode worker, over all backends."""
    total = [0.0, 0.0]
    for key, value in samples.items():
        for i, suffix in enumerate(("disagg_kv_pull_seconds_sum", "disagg_kv_pull_seconds_count")):
            if key.startswith(suffix + "{"):
                total[i] += value
    return total[0], total[1]


def bench(router: ServiceProcess, decode: ServiceProcess, spec: str, output: int, args: argparse.Namespace,
          out: Path, num_prompts: int | None = None) -> dict:
    before = pull_totals(decode)
    result = out / "bench.json"
    input_len = spec if ":" in spec else f"fixed:{spec}"
    command = [sys.executable, "-m", "services", "bench", "--router", router.address, "--num-prompts",
               str(num_prompts or args.num_prompts), "--input-len", input_len, "--output-len", f"fixed:{output}",
               "--max-concurrency", str(args.concurrency), "--warmup", "2", "--token-range", "1000", "120000",
               "--seed", "7", "--no-progress", "--json", str(result)]
    subprocess.run(command, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL, timeout=600)
    summary = json.loads(result.read_text())["summary"]
    after = pull_totals(decode)
    pulls = after[1] - before[1]
    result.unlink()
    breakdown = {part: {"mean": round(d["mean"], 2), "p90": round(d["p90"], 2)}
                 for part, d in (summary.get("ttft_breakdown") or {}).items() if d["count"]}
    return {"completed": summary["completed"], "failed": summary["failed"],
            "output_tok_s": round(summary["output_throughput"], 1),
            "ttft_mean_ms": round(summary["ttft"]["mean"], 1), "ttft_p90_ms": round(summary["ttft"]["p90"], 1),
            "itl_p99_ms": round(summary["itl"]["p99"], 2), "tpot_mean_ms": round(summary["tpot"]["mean"], 2),
            "kv_pulls": int(pulls), "kv_pull_mean_ms": round((after[0] - before[0]) / pulls * 1000, 3) if pulls else None,
            "ttft_breakdown_ms": breakdown}


def run_mode(mode: str, model: Path, workers: list[ServiceProcess], threshold: int, cells: list[tuple[str, int]],
             args: argparse.Namespace, results: list[dict]) -> None:
    router = start_router(model, workers, mode, threshold)
    try:
        for spec in dict.fromkeys(spec for spec, _ in cells):  # warm up: kernels of every shape compiled, not timed
            bench(router, workers[1], spec, 4, args, args.out, num_prompts=args.concurrency)
        for spec, output in cells:
            started = time.monotonic()
            figures = bench(router, workers[1], spec, output, args, args.out)
            record = {"input": spec, "output": output, "mode": mode, "threshold": threshold if mode == "conditional"
                      else None, **figures, "wall_s": round(time.monotonic() - started, 1)}
            results.append(record)
            print(json.dumps(record), flush=True)
            (args.out / "sweep.json").write_text(json.dumps({"config": _config(args), "runs": results}, indent=1))
    finally:
        router.stop()


def _config(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-from", type=Path, required=True)
    parser.add_argument("--shape", default="llama-3.2-3b", choices=sorted(SHAPES))
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "disagg-bench-models")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--inputs", type=lambda t: t.split(","), default=["128", "512", "2048", "8192"])
    parser.add_argument("--outputs", type=lambda t: [int(x) for x in t.split(",")], default=[32, 256])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=6144)
    parser.add_argument("--threshold", type=lambda t: [int(x) for x in t.split(",")], default=None,
                        help="conditional's --max-local-prefill-tokens, one run each (default: the crossover measured "
                             "here)")
    parser.add_argument("--modes", type=lambda t: t.split(","), default=list(MODES))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = model_dir(args.shape, args.tokenizer_from, args.models)
    cells = [(spec, output) for output in args.outputs for spec in args.inputs]
    workers = start_services([("prefill", engine_args(model, args)), ("decode", engine_args(model, args))],
                             timeout_s=900)
    results: list[dict] = []
    try:
        for mode in [m for m in args.modes if m != "conditional"]:
            run_mode(mode, model, workers, 0, cells, args, results)
        measured = crossover(results, args.inputs) if "remote" in args.modes else None
        thresholds = args.threshold if args.threshold is not None else [measured]
        print(json.dumps({"crossover_threshold": measured, "conditional_thresholds": thresholds}), flush=True)
        for threshold in thresholds if "conditional" in args.modes else []:
            run_mode("conditional", model, workers, threshold, cells, args, results)
    finally:
        for worker in workers:
            worker.stop()
    (args.out / "sweep.md").write_text(table(results))
    if len({spec for spec, _ in cells}) > 1:
        plot(results, thresholds[0], args.out / "sweep.png",
             f"{args.shape}, bf16, one GPU, concurrency {args.concurrency}")
    print(table(results), flush=True)
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

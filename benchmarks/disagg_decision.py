"""Conditional disaggregation on one GPU: aggregated vs 1P1D with each --max-local / --max-prefill-queue setting.

    python benchmarks/disagg_decision.py [--shape llama-3.2-3b] [--num-prompts 64] [--input-len uniform:512:2048]

Saves a random bf16 model of the shape, starts one prefill and one decode worker on the same GPU (prefix
caching off, so every run computes the same prompts), then for each router setting starts a router, runs
`disagg bench` (output 128, concurrency 8, the same seed) and prints output tok/s, TTFT and TPOT, and
where the router prefilled (its disagg_routing_prefill_decisions_total).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_engine_vs_hf import SHAPES, make_model  # noqa: E402
from benchmarks.scrape import scrape  # noqa: E402
from benchmarks.processes import REPO_ROOT, ServiceProcess, start_services  # noqa: E402

SETTINGS = {  # name → router flags; None: aggregated (no prefill worker)
    "aggregated": None,
    "1P1D all remote": (),
    "1P1D local <= 1024 uncached": ("--max-local-prefill-tokens", "1024"),
    "1P1D queue limit 4096": ("--max-prefill-queue-tokens", "4096"),
    "1P1D local <= 1024, queue 4096": ("--max-local-prefill-tokens", "1024", "--max-prefill-queue-tokens", "4096"),
}


def bench(router: ServiceProcess, args: argparse.Namespace, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "services", "bench", "--router", router.address, "--num-prompts",
                    str(args.num_prompts), "--input-len", args.input_len, "--output-len", "fixed:128",
                    "--max-concurrency", "8", "--warmup", "4", "--token-range", "1000", "120000",
                    "--no-progress", "--json", str(out)], cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def decisions(router: ServiceProcess) -> str:
    samples = scrape(router)
    found = {key.split("{", 1)[1].rstrip("}"): value for key, value in samples.items()
             if key.startswith("disagg_routing_prefill_decisions_total{")}
    return ", ".join(f"{k}: {v:g}" for k, v in sorted(found.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-3b", choices=sorted(SHAPES))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="uniform:512:2048")
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / args.shape)
        make_model(args.shape, model)
        engine = ("--model", model, "--device", "cuda", "--dtype", "bfloat16", "--block-size", "16",
                  "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-batched-tokens", "8192",
                  "--no-prefix-caching")
        workers = start_services([("prefill", engine), ("decode", engine)], timeout_s=600)
        try:
            for name, flags in SETTINGS.items():
                router_args = ["--model", model, "--decode-workers", workers[1].address]
                if flags is not None:
                    router_args += ["--prefill-workers", workers[0].address, *flags]
                (router,) = start_services([("router", tuple(router_args))])
                try:
                    s = bench(router, args, Path(tmp) / "bench.json")
                    print(json.dumps({"setting": name, "output_tok_s": round(s["output_throughput"], 1),
                                      "ttft_mean_ms": round(s["ttft"]["mean"], 1),
                                      "tpot_mean_ms": round(s["tpot"]["mean"], 2), "failed": s["failed"],
                                      "prefill": decisions(router)}), flush=True)
                finally:
                    router.stop()
        finally:
            for worker in workers:
                worker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

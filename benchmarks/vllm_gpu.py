"""vLLM and `disagg up` on the same GPU, one after the other, with the same model directory, driven by vLLM's own
client (`vllm bench serve`), each figure printed beside the peer's with the ratio and the decode roofline.

    python -m benchmarks.vllm_gpu --model DIR --vllm-site SITE [--load-format dummy] [--dtype bfloat16]
        [--workloads 128:256:1,1024:128:8,512:256:64] [--ours-args "" --ours-args "--prefill 0"] [--json out.json]

Each workload is INPUT:OUTPUT:CONCURRENCY: completions, streaming, random prompts of INPUT tokens (one seed: the same
prompts for both servers), OUTPUT tokens with ignore_eos, at most CONCURRENCY in flight (issue #55's three). Each
server is started, waits for /v1/models, gets a few warm-up requests (not counted), runs every workload and stops;
vLLM first, then each --ours-args as one more `disagg up --device cuda` (its flags beside the defaults: "" is the
default layout and memory, which the targets are about). Both load the same directory (`--load-format dummy` on both
where its weights are random); vLLM runs with its defaults otherwise (0.9 of the GPU, its compile and graphs).

Printed per workload: output tok/s (>= 1 is ours faster), TTFT mean and ITL p99 (<= 1 is ours faster), and the
decode roofline: CONCURRENCY rows reading the weights once a step at the HBM bandwidth measured here (a
device-to-device copy), so no server can stream faster than that.

vLLM is not a dependency of ours: it pins its own xgrammar and pydantic. Install it into a site of its own
(`../shared/tools/vllm-gpu-wheels.sh` makes the wheels for a machine without a package index):

    python3 -m pip install --no-index --no-deps --target SITE WHEELS/*.whl

The vLLM server and client run with PYTHONPATH=SITE (only); our servers with this process's environment.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.vllm_cpu import Server, stop_on_sigterm  # noqa: E402
from benchmarks.processes import REPO_ROOT  # noqa: E402

DEFAULT_WORKLOADS = "128:256:1,1024:128:8,512:256:64"
WARMUP = "128:16:4"
# vllm bench serve's result keys, our names, and which way is better.
METRICS = (("output_throughput", "out tok/s", "higher"), ("mean_ttft_ms", "TTFT mean ms", "lower"),
           ("p99_ttft_ms", "TTFT p99 ms", "lower"), ("p99_itl_ms", "ITL p99 ms", "lower"),
           ("mean_itl_ms", "ITL mean ms", "lower"), ("mean_tpot_ms", "TPOT mean ms", "lower"))


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    concurrency: int

    @classmethod
    def parse(cls, text: str) -> "Workload":
        i, o, c = (int(x) for x in text.split(":"))
        return cls(i, o, c)

    @property
    def name(self) -> str:
        return f"{self.input_len} in / {self.output_len} out, c{self.concurrency}"

    def prompts(self, seconds_of_work: float) -> int:
        """Enough requests for a steady state: a few waves of `concurrency`, and at least 16."""
        return max(16, 4 * self.concurrency, int(seconds_of_work * self.concurrency))


def model_id(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def bench(server: Server, workload: Workload, prompts: int, args: argparse.Namespace, out: Path) -> dict:
    """One `vllm bench serve` run; its result JSON."""
    name = f"{server.name.replace(' ', '_')}-{workload.input_len}-{workload.output_len}-c{workload.concurrency}.json"
    command = [args.python, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
               "--base-url", server.url, "--endpoint", "/v1/completions", "--model", model_id(server.url),
               "--tokenizer", str(args.model), "--dataset-name", "random",
               "--random-input-len", str(workload.input_len), "--random-output-len", str(workload.output_len),
               "--num-prompts", str(prompts), "--max-concurrency", str(workload.concurrency), "--ignore-eos",
               "--seed", "55", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
               "--save-result", "--result-dir", str(out), "--result-filename", name]
    done = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(args.vllm_site)},
                          capture_output=True, text=True, timeout=args.bench_timeout)
    if done.returncode:
        raise RuntimeError(f"vllm bench serve against {server.name} failed ({done.returncode}):\n"
                           + "".join(done.stdout.splitlines(True)[-20:]) + "".join(done.stderr.splitlines(True)[-20:]))
    return json.loads((out / name).read_text())


def servers(args: argparse.Namespace) -> list[Server]:
    vllm_env = {"PYTHONPATH": str(args.vllm_site)}
    vllm = Server("vllm", [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
                           "--dtype", args.dtype, "--load-format", args.load_format, "--port", str(args.port),
                           *args.vllm_args.split()], vllm_env, args.port)
    up = [args.python, "-m", "services", "up", "--device", "cuda", "--model", str(args.model), "--dtype", args.dtype,
          "--load-format", args.load_format, "--http-port", str(args.port + 1), "--router-port", "0",
          "--metrics-port-base", "-1"]
    ours = [Server(f"disagg {flags}".strip(), [*up, *flags.split()], {}, args.port + 1) for flags in args.ours_args]
    return ours if args.only_ours else ours + [vllm] if args.ours_first else [vllm, *ours]


def decode_roofline(model: Path) -> tuple[float, float]:
    """(weight bytes, HBM bytes/s): the bf16 bytes one decode step reads at least, and the device's copy bandwidth."""
    import torch

    from benchmarks.gpu_engine_vs_hf import hbm_bandwidth, model_figures, shape_config

    weights, _ = model_figures(shape_config(str(model)))
    bandwidth = hbm_bandwidth()
    torch.cuda.empty_cache()  # the copy's buffers: the servers size their KV caches from what is free
    return weights, bandwidth


def report(results: dict, workloads: list[Workload], names: list[str], weights: float, bandwidth: float) -> str:
    lines = [f"decode roofline: {weights / 1e9:.2f} GB of weights a step at {bandwidth / 1e12:.2f} TB/s = "
             f"{weights / bandwidth * 1e3:.2f} ms a step"]
    for w in workloads:
        limit = w.concurrency * bandwidth / weights
        lines.append(f"\n{w.name} (roofline {limit:.0f} out tok/s)")
        lines.append("| server | " + " | ".join(label for _, label, _ in METRICS) + " |")
        lines.append("| --- " * (len(METRICS) + 1) + "|")
        for name in names:
            r = results[name].get(w.name)
            if r is None:
                lines.append(f"| {name} | " + " | ".join("failed" for _ in METRICS) + " |")
                continue
            cells = []
            for key, _, _ in METRICS:
                cell = f"{r[key]:.1f}"
                peer = results.get("vllm", {}).get(w.name)
                if name != "vllm" and peer and peer[key]:
                    cell += f" ({r[key] / peer[key]:.2f}×)"
                cells.append(cell)
            lines.append(f"| {name} | " + " | ".join(cells) + f" | ({r['output_throughput'] / limit:.0%} of "
                         "roofline)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a model directory (config.json and tokenizer files)")
    p.add_argument("--vllm-site", type=Path, required=True, help="the --target directory vLLM was installed into")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="auto", help="both servers' --dtype (auto: the checkpoint's half precision)")
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS, help="INPUT:OUTPUT:CONCURRENCY, comma-separated")
    p.add_argument("--seconds", type=float, default=2.0,
                   help="requests per workload: this many times its concurrency (at least 4 waves, 16 requests)")
    p.add_argument("--ours-args", action="append", default=None,
                   help="`disagg up` flags beside the defaults; repeat it to compare (default: one, the defaults)")
    p.add_argument("--vllm-args", default="", help="vLLM server flags beside --model, --dtype, --load-format")
    p.add_argument("--only-ours", action="store_true")
    p.add_argument("--ours-first", action="store_true", help="start ours before vLLM")
    p.add_argument("--no-warmup", action="store_true", help="no warm-up requests before the workloads")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--port", type=int, default=8200, help="vLLM's HTTP port; ours takes the next one")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--bench-timeout", type=float, default=300.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.ours_args = args.ours_args or [""]
    workloads = [Workload.parse(w) for w in args.workloads.split(",")]
    args.model = args.model.resolve()  # (transformers reads a relative path as a hub name)
    stop_on_sigterm()
    weights, bandwidth = decode_roofline(args.model)
    order = servers(args)
    results: dict = {s.name: {} for s in order}
    ready: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="vllm-gpu-bench-") as tmp:
        for server in order:
            try:
                ready[server.name] = server.start(Path(tmp), args.start_timeout)
                print(f"{server.name}: answering after {ready[server.name]:.0f} s", flush=True)
                if not args.no_warmup:
                    warm = Workload.parse(WARMUP)
                    bench(server, warm, warm.prompts(0), args, Path(tmp))
                for w in workloads:
                    results[server.name][w.name] = bench(server, w, w.prompts(args.seconds), args, Path(tmp))
                    r = results[server.name][w.name]
                    print(f"{server.name} {w.name}: " + ", ".join(f"{label} {r[key]:.1f}" for key, label, _ in METRICS),
                          flush=True)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"{server.name}: {exc}", flush=True)
                if server.log and server.log.exists():
                    print("".join(server.log.read_text().splitlines(True)[-30:]), flush=True)
            finally:
                server.stop()
    names = [s.name for s in order]
    print(report(results, workloads, names, weights, bandwidth))
    print("ready (s): " + ", ".join(f"{n} {t:.0f}" for n, t in ready.items()))
    if args.json:
        keep = {n: {w: {k: r[k] for k in (*(m[0] for m in METRICS), "completed", "num_prompts") if k in r}
                    for w, r in runs.items()} for n, runs in results.items()}
        args.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "ready_s": ready,
                                         "weights_bytes": weights, "hbm_bytes_s": bandwidth, "results": keep},
                                        indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

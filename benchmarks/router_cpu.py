"""The router's CPU per streamed token: what caps the tokens/s one router can stream, on any machine.

    python -m benchmarks.router_cpu [--rate 30] [--num-prompts 200] [--routers 1] [--decode-streams both]
        [--profile-s 8]

A tiny random Llama (one layer, hidden 32, the 128k vocabulary of Llama 3, the default model's tokenizer files) on a
CPU decode worker, the router(s) over it, and `disagg bench` (input uniform 64–128, output 128, Poisson --rate).
Prints each process's CPU seconds during the timed run per output token. The physical limit is one core per router:
a router's event loop is one thread, so 1 s / (its µs per token) is the most tokens/s it can stream. On 4 × H200 one
router kept 0.9–0.99 cores busy at ~6 900 tokens/s (benchmarks/multi_gpu.py's `cores_busy`), about 140 µs a token.
With --profile-s, py-spy (if installed) samples the first router for that long and the hottest frames are printed:
on the 2-core development machine at ~1 800 tokens/s, before streams merged what piled up, the server-streaming
client write (services/router/frontends/grpc.py) was 36 % of the router's busy samples.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_kv_plane import TOKENIZER_FILES  # noqa: E402
from services.router.config import DECODE_STREAMS  # noqa: E402
from benchmarks.multi_gpu import role_cpu  # noqa: E402
from benchmarks.processes import REPO_ROOT, ServiceProcess, start_services  # noqa: E402

OUTPUT_TOKENS = 128
# Leaves of threads that wait (the tokenizer's pool, gRPC's poller, Prometheus' HTTP server): not the loop's work.
_IDLE = ("_worker (concurrent", "Thread.run (threading", ".select (selectors")


def tiny_model(directory: Path) -> Path:
    """A one-layer random Llama with Llama 3's vocabulary and the default model's tokenizer files (made once)."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.engine.default_model import resolve_model

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=128256, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    source = resolve_model("default")
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, directory / name)
    return directory


def bench(routers: list[ServiceProcess], rate: float, prompts: int, result: Path | None) -> None:
    command = [sys.executable, "-m", "services", "bench", "--router", ",".join(r.address for r in routers),
               "--num-prompts", str(prompts), "--input-len", "uniform:64:128", "--output-len",
               f"fixed:{OUTPUT_TOKENS}", "--request-rate", str(rate), "--token-range", "1000", "120000",
               "--warmup", "0", "--no-progress", *(["--json", str(result)] if result else [])]
    subprocess.run(command, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL, timeout=600)


def hottest(raw: Path, top: int = 12) -> list[str]:
    """py-spy raw samples: the share of the busy samples (idle waits left out) each leaf frame holds."""
    leaves, busy = Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        leaf = stack.split(";")[-1]
        if any(idle in leaf for idle in _IDLE):
            continue
        busy += int(count)
        leaves[leaf] += int(count)
    return [f"{n / busy:6.1%}  {leaf}" for leaf, n in leaves.most_common(top)] if busy else []


def timed_run(routers: list[ServiceProcess], worker: ServiceProcess, args: argparse.Namespace,
              scratch: Path) -> tuple[dict, dict[str, float], list[str]]:
    """One bench run: its summary, the CPU seconds each role used during it (the bench client's: `bench`), and, with
    --profile-s, the first router's hottest frames."""
    result, raw = scratch / "bench.json", scratch / "router.spy"
    spy = None
    if args.profile_s and shutil.which("py-spy"):
        spy = subprocess.Popen(["py-spy", "record", "-r", "200", "-d", str(args.profile_s), "-f", "raw", "-o", str(raw),
                                "-p", str(routers[0].popen.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    before = role_cpu([*routers, worker])
    bench(routers, args.rate, args.num_prompts, result)
    used = {role: seconds - before[role] for role, seconds in role_cpu([*routers, worker]).items()}
    frames: list[str] = []
    if spy is not None:
        _, errors = spy.communicate(timeout=args.profile_s + 30)
        frames = hottest(raw) if raw.exists() else [f"py-spy wrote nothing: {errors.strip()[-300:]}"]
    return json.loads(result.read_text())["summary"], used, frames


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=30.0)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--routers", type=int, default=1)
    parser.add_argument("--decode-streams", choices=[*DECODE_STREAMS, "both"], default="both",
                        help="the router's --decode-streams; both: one run each, shared first")
    parser.add_argument("--profile-s", type=int, default=0, help="py-spy the first router this long")
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "disagg-bench-models")
    args = parser.parse_args()
    model = tiny_model(args.models / "router-cpu-tiny")
    worker = start_services([("decode", ("--model", str(model), "--device", "cpu", "--max-num-seqs", "256",
                                         "--num-kv-blocks", "20000"))])[0]
    try:
        for mode in DECODE_STREAMS if args.decode_streams == "both" else [args.decode_streams]:
            report(mode, *run_mode(mode, model, worker, args), args)
    finally:
        worker.stop()
    return 0


def run_mode(mode: str, model: Path, worker: ServiceProcess,
             args: argparse.Namespace) -> tuple[dict, dict[str, float], list[str]]:
    routers: list[ServiceProcess] = []
    try:
        routers = start_services([("router", ("--model", str(model), "--decode-workers", worker.address,
                                              "--decode-streams", mode))] * args.routers)
        bench(routers, args.rate, 20, None)  # warm-up
        with tempfile.TemporaryDirectory() as scratch:
            return timed_run(routers, worker, args, Path(scratch))
    finally:
        for process in routers:
            process.stop()


def report(mode: str, summary: dict, used: dict[str, float], frames: list[str], args: argparse.Namespace) -> None:
    tokens = summary["completed"] * OUTPUT_TOKENS
    print(f"--decode-streams {mode}: {summary['request_throughput']:.1f} req/s, {summary['output_throughput']:.0f} "
          f"output tok/s at {args.rate:g} req/s offered; TTFT p90 {summary['ttft']['p90']:.0f} ms, "
          f"ITL p99 {summary['itl']['p99']:.1f} ms")
    for role, seconds in used.items():
        per_token = seconds / tokens * 1e6
        # A router's loop is one thread: N routers stream at most N cores' worth.
        limit = f": at most {args.routers * 1e6 / per_token:,.0f} tok/s on {args.routers} core(s)" \
            if role == "router" else ""
        print(f"{'bench client' if role == 'bench' else role:>12}: {seconds:6.2f} CPU s, {per_token:5.0f} µs a token"
              f"{limit}")
    for busy in summary.get("client_loop_busy") or []:  # the sending loop alone, without the bench's start and summary
        per_token = busy * summary["duration_s"] / tokens * 1e6
        print(f"{'client loop':>12}: {busy:.2f} of a core while it sent, {per_token:5.0f} µs a token")
    if frames:
        print("router's hottest frames (share of busy samples):\n  " + "\n  ".join(frames))


if __name__ == "__main__":
    sys.exit(main())

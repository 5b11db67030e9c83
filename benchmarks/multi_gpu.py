"""Disaggregation on a multi-GPU host: N × aggregated against every xPyD split, over a Poisson rate sweep.

    python -m benchmarks.multi_gpu --tokenizer-from DIR [--layouts 2xagg,1P1D] [--rates 8,16,24,32,40,48]
        [--num-prompts 200] [--input-len uniform:512:2048] [--output-len 128] [--slo-ttft-p90-ms 250]
        [--slo-itl-p99-ms 15] [--agg-chunks 512,2048 [--only-agg-chunks]] [--budget-s 540] [--out DIR]

Saves a random bf16 model of --shape (with DIR's tokenizer files; --load-format dummy: its config.json alone, the
workers make the weights on their GPUs, e.g. `--shape llama-3.1-8b --load-format dummy`), then for each layout
starts its workers, each on the GPUs it is given (`--device cuda:N`; a TP worker on N..N+tp-1) and a router over
them, and runs `disagg bench` at each Poisson --rates point (the same seed and prompts for every layout) until
the layout saturates (it completes under 75 % of the offered rate (a short run's rate counts its tail), fails a
request, or its TTFT p90 passes 4× the SLO's). Layouts:
- `Kxagg`: K aggregated workers, one a GPU (the router with no prefill worker); with --agg-chunks, one run per
  chunked-prefill size (a step's token budget: --max-num-batched-tokens and --long-prefill-token-threshold), so
  the peer is the best aggregated setup, not the default,
- `xPyD`: x prefill and y decode workers, one a GPU, prefill first (`1P1D`, `1P3D`, `2P2D`, `3P1D`),
- `tp2-xPyD`: the prefill workers at TP 2 (`tp2-1P2D`: prefill on GPUs 0-1, decode on 2 and 3),
- a `+q` suffix (`1P1D+q`): the router's --max-prefill-queue-tokens --queue-tokens and --max-local-prefill-tokens
  --local-tokens, so a decode worker with room prefills short prompts itself while the prefill GPU is behind
  (in chunks of --local-chunk tokens beside its decode rows),
Each point records output tok/s, TTFT mean / p90, TPOT mean, ITL p99, the requests / s whose own TTFT and TPOT are
within the SLO's limits, and whether the point meets the SLO (TTFT p90 and ITL p99 within the limits); its SLO goodput
is its completed requests / s where it does, 0 where it does not, with decode's mean KV pull (its
disagg_kv_pull_seconds) and where the router prefilled. Everything lands in OUT/multi_gpu.json as it is measured, then
OUT/multi_gpu.md (the table, with each layout's highest rate that meets the SLO, and each split against the best
aggregated run: the ratio of their SLO rates, and at every rate both ran below saturation their ITL p99, TTFT p90 and
output tok/s ratios) and OUT/multi_gpu.png (SLO goodput against rate, per layout). Each point also keeps its TTFT
breakdown (the router's parts: mean and p90 of router queue, prefill queue, prefill compute, KV handoff, first decode
step, and `other` with its two sides, router <-> worker and client <-> router), `itl_split` (requests' first gaps, the
handoff in a split, apart from the rest, whose long gaps decide whether the p99 falls on them), `output_wait_ms` (each
role's mean wait of a step's outputs for its worker's event loop: disagg_engine_output_wait_seconds), `loop_lag_ms`
(the routers' event-loop lag while requests were in flight: disagg_event_loop_lag_seconds), `cores_busy`
(the cores each role's processes and the bench client kept busy: a router near 1.0 is saturated, its one event loop
the limit; a point where a router or bench client process kept 0.85 of a core or more says so, `apparatus_bound`, in
its record and under the table: it measured them as much as the layout), `gc_pauses` (each role's oldest-generation
collections and their ms) and `disagg bench`'s JSON, per request, in OUT/points/. --routers and --bench-clients
default to enough processes for the highest rate's output tokens/s (ROUTER_TOK_S, CLIENT_TOK_S a process): at 72 req/s
x 128 tokens one router would stream 9 216 tok/s, past what its event loop relays without delaying the tokens.

--step-times: each point gets `decode_steps`, read from the decode workers' engine step metrics
(disagg_engine_step_*, scraped before and after it: benchmarks/step_metrics.py): the step period (start to start,
what a token's ITL is made of) p50 / p90 / p99 and mean (quantiles from the histogram's buckets), the steps' mean wall,
engine-thread CPU and rows, the share of periods begun by a step not launched ahead (async scheduling's pipeline
broken: a request joined or the batch changed), the long periods (over 2.5 × the median) and how many of them began
so; and where a decode worker prefilled prompts itself (`+q`), the share of mixed periods (begun by a step with a
prompt chunk beside its decode rows) and their p50 / p99. So an ITL p99 says whether it is GPU work, host work or
waiting. A metric holds no single step, so what the long periods' own steps did (their batch change, wall, CPU and the
gap after them) is not in it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.config import EngineConfig, default_max_num_seqs  # noqa: E402
from services.cli.bench.workload import LengthDist  # noqa: E402
from services.cli.bench.stats import CLIENT_LOOP_SATURATED  # noqa: E402
from services.router.config import DECODE_STREAMS  # noqa: E402
from benchmarks.disagg_sweep import pull_sums  # noqa: E402
from benchmarks.gpu_engine_vs_hf import SHAPES, shape_arg  # noqa: E402
from benchmarks.gpu_kv_plane import model_dir  # noqa: E402
from benchmarks.cpu_time import TICKS_PER_S, cpu_ticks  # noqa: E402
from benchmarks.scrape import scrape  # noqa: E402
from benchmarks.step_metrics import step_summary, window  # noqa: E402
from benchmarks.processes import REPO_ROOT, ServiceProcess, start_services  # noqa: E402

# What one process of the measuring side streams while it stays well inside its one event loop
# (docs/benchmarks/multi_gpu.md: one router streams about 7 000 tokens/s with a Decode stream per request and 11 000
# with shared streams at a whole core; two bench clients timing 7 000 tok/s between them used 0.86-0.92 of a core each,
# start-up and gRPC's threads included (their sending loops alone: ~30 µs a token on the 2-core
# machine, benchmarks/router_cpu.py), so one client per 3 000 tok/s keeps well clear). --routers 0 / --bench-clients
# 0 start enough of each.
ROUTER_TOK_S = 5000
CLIENT_TOK_S = 3000
# A router or bench client process this busy (cores) measures itself: its loop delays every token it relays or
# times, which lands in TTFT's `other` and in the gaps.
APPARATUS_BUSY = CLIENT_LOOP_SATURATED  # one event loop at its ceiling, a router's as a client's
_LAYOUT = re.compile(r"^(?:(?P<agg>\d+)xagg|(?:tp(?P<tp>\d+)-)?(?P<p>\d+)P(?P<d>\d+)D)(?P<queue>\+q)?$")


@dataclass(frozen=True)
class Layout:
    name: str
    prefill: int  # workers
    decode: int
    prefill_tp: int = 1
    queue_limited: bool = False

    @classmethod
    def parse(cls, name: str) -> "Layout":
        m = _LAYOUT.match(name)
        if not m:
            raise argparse.ArgumentTypeError(f"layout {name!r}: Kxagg, xPyD, tp2-xPyD, with an optional +q")
        if m["agg"]:
            return cls(name, 0, int(m["agg"]), queue_limited=bool(m["queue"]))
        return cls(name, int(m["p"]), int(m["d"]), int(m["tp"] or 1), bool(m["queue"]))

    @property
    def gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode

    def devices(self) -> list[tuple[str, int, int]]:
        """(role, first GPU, tp) per worker: prefill workers first, then decode, each on the next free GPUs."""
        out, gpu = [], 0
        for role, count, tp in (("prefill", self.prefill, self.prefill_tp), ("decode", self.decode, 1)):
            for _ in range(count):
                out.append((role, gpu, tp))
                gpu += tp
        return out


def engine_args(model: Path, args: argparse.Namespace) -> tuple[str, ...]:
    return ("--model", str(model), "--dtype", "bfloat16", "--num-kv-blocks", str(args.kv_blocks),
            "--max-model-len", str(args.max_model_len), "--no-prefix-caching", "--session-ttl", "120",
            "--load-format", args.load_format,
            *(("--max-num-seqs", str(args.max_num_seqs)) if args.max_num_seqs else ()),
            *(("--kv-growth-reserve", str(args.kv_growth_reserve)) if args.kv_growth_reserve is not None else ()))


def start_layout(layout: Layout, model: Path, args: argparse.Namespace, chunk: int | None,
                 streams: str = "shared") -> tuple[list[ServiceProcess], list[ServiceProcess]]:
    specs = []
    for role, gpu, tp in layout.devices():
        flags = (*engine_args(model, args), "--device", f"cuda:{gpu}", "--tensor-parallel-size", str(tp))
        step_tokens = chunk if chunk is not None else (
            args.local_chunk if layout.queue_limited and role == "decode" else 0)
        if role == "prefill" and args.prefill_budget:
            step_tokens = args.prefill_budget
        if step_tokens:  # the step's whole budget: a threshold alone bounds one prompt's chunk, not the step's
            flags += ("--max-num-batched-tokens", str(step_tokens), "--long-prefill-token-threshold", str(step_tokens))
        specs.append((role, flags))
    workers = start_services(specs, timeout_s=600)
    prefill = [w.address for w, (role, _) in zip(workers, specs) if role == "prefill"]
    decode = [w.address for w, (role, _) in zip(workers, specs) if role == "decode"]
    flags = ["--model", str(model), "--decode-workers", ",".join(decode), "--http-port", "0",
             "--policy", "least_loaded", "--decode-streams", streams]
    if prefill:
        flags += ["--prefill-workers", ",".join(prefill)]  # the router's defaults: every prompt remote
        if layout.queue_limited:
            flags += ["--max-prefill-queue-tokens", str(args.queue_tokens),
                      "--max-local-prefill-tokens", str(args.local_tokens)]
    try:
        routers = start_services([("router", tuple(flags))] * args.routers)
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers, routers


def pool_note(args: argparse.Namespace, block_size: int = EngineConfig.block_size) -> str | None:
    """A line when a worker's KV pool holds fewer requests of the mean size than --max-num-seqs admits: past that
    many rows in flight (an overloaded point, or slow steps that keep rows longer) a decode worker leaves handoffs
    queued (its KV growth reserve; before it, it preempted rows, which recomputed their prompts on the decode GPU:
    1P1D+q at 80 req/s on 2 H200s collapsed so with 8192 blocks, TPOT 20 ms)."""
    tokens = LengthDist.parse(args.input_len).mean + args.output_len
    holds = int(args.kv_blocks * block_size // tokens)
    rows = args.max_num_seqs or default_max_num_seqs("cuda")  # 0: the workers' default on a GPU
    if holds >= rows:
        return None
    return (f"# note: --kv-blocks {args.kv_blocks} hold about {holds} requests of {tokens:g} tokens, fewer than "
            f"the {rows} rows a worker admits (--max-num-seqs): past {holds} rows a decode worker queues handoffs")


def ttft_parts(s: dict) -> dict[str, list[float]] | None:
    """The router's TTFT breakdown: [mean, p90] ms by part (and `other_ms`, the client's TTFT less the first three)."""
    if not s.get("ttft_breakdown"):
        return None
    return {part.removesuffix("_ms"): [round(d["mean"], 1), round(d["p90"], 1)]
            for part, d in s["ttft_breakdown"].items() if d and d.get("count")}


def bench_point(routers: list[ServiceProcess], rate: float, num_prompts: int, args: argparse.Namespace,
                keep: str | None = None) -> dict:
    """`disagg bench`'s summary of the point, with its `itl_split`; with `keep`, its JSON stays in OUT/points."""
    result = args.out / "point.json"
    command = [sys.executable, "-m", "services", "bench", "--router", ",".join(r.address for r in routers),
               "--num-prompts", str(num_prompts), "--input-len", args.input_len,
               "--output-len", f"fixed:{args.output_len}",
               "--request-rate", str(rate), "--warmup", "4", "--token-range", "1000", "120000", "--seed", "7",
               "--goodput-ttft-ms", str(args.slo_ttft_p90_ms), "--goodput-tpot-ms", str(args.slo_itl_p99_ms),
               "--no-progress", "--json", str(result), "--clients", str(args.bench_clients),
               "--temperature", str(args.temperature)]
    subprocess.run(command, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL, timeout=300)
    point = json.loads(result.read_text())
    summary = {**point["summary"], "itl_split": itl_split(point["requests"])}
    if keep:
        (args.out / "points").mkdir(exist_ok=True)
        result.replace(args.out / "points" / f"{keep}.json")
    else:
        result.unlink()
    return summary


def point_prompts(rate: float, args: argparse.Namespace) -> int:
    """Requests at one point: --num-prompts, or --point-s seconds of arrivals where that is more. A point's achieved
    rate counts its tail (the last requests' decode, about 0.7 s here): 200 requests at 112 req/s achieve at most
    about 80 however fast the layout, 640 about 100."""
    return max(args.num_prompts, round(rate * args.point_s))


@dataclass
class Reading:
    """One side of a point, every process read once: its /metrics samples and its CPU seconds so far (the bench
    clients', finished children of this process, as `bench`)."""

    samples: dict[ServiceProcess, dict[str, float]]
    cpu: dict[ServiceProcess | str, float]

    @classmethod
    def of(cls, processes: list[ServiceProcess]) -> "Reading":
        return cls({p: scrape(p) for p in processes}, process_cpu(processes))

    def of_role(self, role: str) -> dict[ServiceProcess, dict[str, float]]:
        return {p: samples for p, samples in self.samples.items() if p.role == role}

    def role_cpu(self) -> dict[str, float]:
        return cpu_by_role(self.cpu)

    def routers_cpu(self) -> dict[str, float]:
        """Each router process's CPU seconds so far, by its name."""
        return {p.name: s for p, s in self.cpu.items() if not isinstance(p, str) and p.role == "router"}


def decisions(reading: Reading) -> dict[str, float]:
    """Where the routers placed prompts so far (reason and side → count), over every router."""
    totals: dict[str, float] = {}
    for samples in reading.of_role("router").values():
        for key, value in samples.items():
            if key.startswith("disagg_routing_prefill_decisions_total{"):
                label = key.split("{", 1)[1].rstrip("}")
                totals[label] = totals.get(label, 0.0) + value
    return totals


def mean_pull_ms(after: Reading, before: Reading) -> float | None:
    """Decode's mean KV pull during one point, over every decode worker."""
    pulls = [(pull_sums(samples), pull_sums(before.samples[p])) for p, samples in after.of_role("decode").items()]
    seconds = sum(a[0] - b[0] for a, b in pulls)
    count = sum(a[1] - b[1] for a, b in pulls)
    return round(seconds / count * 1000, 3) if count else None


# Unlabelled histograms of waits read per point: each role's mean over the point.
WAITS = {"output_wait_ms": "disagg_engine_output_wait_seconds", "loop_lag_ms": "disagg_event_loop_lag_seconds"}


def wait_totals(reading: Reading) -> dict[str, dict[str, tuple[float, float]]]:
    """WAITS key → role → (seconds, count) of its histogram so far, over the role's processes."""
    totals: dict[str, dict[str, tuple[float, float]]] = {key: {} for key in WAITS}
    for process, samples in reading.samples.items():  # (the scrape drops model and role: the keys carry no labels)
        for key, name in WAITS.items():
            waited = [samples.get(f"{name}_{suffix}", 0.0) for suffix in ("sum", "count")]
            if waited[1]:
                before = totals[key].get(process.role, (0.0, 0.0))
                totals[key][process.role] = (before[0] + waited[0], before[1] + waited[1])
    return totals


def mean_ms_by_role(after: dict[str, tuple[float, float]], before: dict[str, tuple[float, float]]) -> dict:
    """role → the mean ms of what a histogram observed during one point."""
    out = {}
    for role, (seconds, count) in after.items():
        was = before.get(role, (0.0, 0.0))
        if count > was[1]:
            out[role] = round((seconds - was[0]) / (count - was[1]) * 1000, 3)
    return out


def decode_steps(after: Reading, before: Reading) -> dict | None:
    """The decode workers' engine steps during one point (see --step-times)."""
    decode = after.of_role("decode")
    return step_summary(window(list(decode.values()), [before.samples[p] for p in decode]))


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU seconds so far (all its threads)."""
    return cpu_ticks(pid) / TICKS_PER_S


def process_cpu(processes: list[ServiceProcess]) -> dict[ServiceProcess | str, float]:
    """Each process's CPU seconds so far, and the bench clients' (finished children of this process) as `bench`."""
    cpu: dict[ServiceProcess | str, float] = {p: cpu_seconds(p.popen.pid) for p in processes}
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu["bench"] = children.ru_utime + children.ru_stime
    return cpu


def cpu_by_role(cpu: dict[ServiceProcess | str, float]) -> dict[str, float]:
    """role → CPU seconds, over the role's processes (the bench clients': `bench`)."""
    totals: dict[str, float] = {}
    for process, seconds in cpu.items():
        role = process if isinstance(process, str) else process.role
        totals[role] = totals.get(role, 0.0) + seconds
    return totals


def role_cpu(processes: list[ServiceProcess]) -> dict[str, float]:
    """role → CPU seconds so far (benchmarks/router_cpu.py's reading, no metrics)."""
    return cpu_by_role(process_cpu(processes))


def replicas(rates: list[float], output_len: int, tok_s: float) -> int:
    """Processes of the measuring side (routers or bench clients) for the highest rate's output tokens/s."""
    return max(1, math.ceil(max(rates) * output_len / tok_s))


def apparatus_bound(router_before: dict[str, float], router_after: dict[str, float], client_loops: list[float],
                    bench_cores: float, clients: int, seconds: float) -> list[str]:
    """The measuring processes that kept APPARATUS_BUSY of a core or more during a point: the point measured them as
    much as the layout. A bench client by its event loop's own busy share while it sent (`disagg bench`'s
    client_loop_busy); a bench without it, by its processes' CPU over the point (their start and the summary too)
    shared among the clients."""
    cores = {name: (after - router_before.get(name, 0.0)) / seconds for name, after in router_after.items()}
    busy = [f"{name} {used:.2f} cores" for name, used in cores.items() if used >= APPARATUS_BUSY]
    if client_loops:
        if max(client_loops) >= APPARATUS_BUSY:
            busy.append(f"bench client loop {max(client_loops):.2f} cores"
                        + (f" (the busiest of {len(client_loops)})" if len(client_loops) > 1 else ""))
    elif bench_cores / clients >= APPARATUS_BUSY:
        busy.append(f"bench client{'s' if clients > 1 else ''} {bench_cores / clients:.2f} cores each")
    return busy


def cores_busy(after: dict[str, float], before: dict[str, float], seconds: float) -> dict[str, float]:
    """role → cores its processes kept busy during one point (a router near 1.0 is the point's bottleneck: one
    event loop)."""
    return {role: round((a - before.get(role, 0.0)) / seconds, 2) for role, a in after.items()}


def gc_pauses(reading: Reading) -> dict[str, list[float]]:
    """role → [oldest-generation collections, their seconds] so far, over the role's processes."""
    totals: dict[str, list[float]] = {}
    for process, samples in reading.samples.items():
        total = totals.setdefault(process.role, [0.0, 0.0])
        total[0] += samples.get('disagg_gc_pause_seconds_count{generation="2"}', 0.0)
        total[1] += samples.get('disagg_gc_pause_seconds_sum{generation="2"}', 0.0)
    return totals


def gc_pause_delta(after: dict[str, list[float]], before: dict[str, list[float]]) -> dict[str, list[float]]:
    """role → [oldest-generation collections, their total ms] during one point."""
    return {role: [int(a[0] - before[role][0]), round((a[1] - before[role][1]) * 1000, 1)]
            for role, a in after.items()}


def itl_split(requests: list[dict]) -> dict[str, float] | None:
    """A request's first gap (its second token: in a split, the handoff) apart from the rest: the p99 falls on the
    first gaps (1 in output-1 of them) when the rest has few gaps as long."""
    first = sorted(r["itl_ms"][0] for r in requests if r.get("itl_ms"))
    rest = sorted(x for r in requests for x in (r.get("itl_ms") or [])[1:])
    if not first or len(rest) < 100:
        return None
    return {"first_p50_ms": round(first[len(first) // 2], 2), "rest_p99_ms": round(rest[int(len(rest) * 0.99)], 2),
            "rest_p998_ms": round(rest[int(len(rest) * 0.998)], 2),
            "rest_over_8ms_share": round(sum(x > 8 for x in rest) / len(rest), 4)}


def meets(point: dict, args: argparse.Namespace) -> bool:
    return (point["failed"] == 0 and point["ttft_p90_ms"] <= args.slo_ttft_p90_ms
            and point["itl_p99_ms"] <= args.slo_itl_p99_ms)


def sweep(layout: Layout, chunk: int | None, model: Path, args: argparse.Namespace, results: list[dict],
          deadline: float, streams: str = "shared") -> None:
    label = layout.name if chunk is None else f"{layout.name} chunk {chunk}"
    label += f" x{args.routers} routers" if args.routers > 1 else ""
    label += f" ({streams} decode streams)" if len(args.decode_streams) > 1 else ""
    started = time.monotonic()
    workers, routers = start_layout(layout, model, args, chunk, streams)
    print(f"# {label}: up in {time.monotonic() - started:.0f}s", flush=True)
    try:
        # Warm-up, not timed: every kernel shape compiled and every graph captured. 16 requests left a chunked
        # aggregated layout's first point with compiles in it (2xagg chunk 512 failed at 32 req/s, passed at 40).
        bench_point(routers, args.rates[0], 64, args)
        for rate in args.rates:
            if time.monotonic() > deadline:
                print(f"# {label}: --budget-s spent, sweep cut at {rate} req/s", flush=True)
                return
            before = Reading.of([*workers, *routers])
            started_at = time.perf_counter()
            s = bench_point(routers, rate, point_prompts(rate, args), args, keep=f"{label.replace(' ', '-')}-{rate:g}")
            seconds = time.perf_counter() - started_at
            after = Reading.of([*workers, *routers])
            busy = cores_busy(after.role_cpu(), before.role_cpu(), seconds)
            loops = s.get("client_loop_busy") or []
            bound = apparatus_bound(before.routers_cpu(), after.routers_cpu(), loops, busy["bench"],
                                    args.bench_clients, seconds)
            routed, routed_after = decisions(before), decisions(after)
            point = {"layout": layout.name, "label": label, "chunk": chunk, "decode_streams": streams, "rate": rate,
                     "completed": s["completed"], "failed": s["failed"],
                     "achieved_req_s": round(s["request_throughput"], 2),
                     "output_tok_s": round(s["output_throughput"], 1),
                     "ttft_mean_ms": round(s["ttft"]["mean"], 1), "ttft_p90_ms": round(s["ttft"]["p90"], 1),
                     "tpot_mean_ms": round(s["tpot"]["mean"], 2), "itl_p99_ms": round(s["itl"]["p99"], 2),
                     "goodput_req_s": round(s["goodput"] or 0.0, 2), "kv_pull_mean_ms": mean_pull_ms(after, before),
                     "prefilled": {k: v - routed.get(k, 0) for k, v in routed_after.items() if v - routed.get(k, 0)},
                     "ttft_parts_ms": ttft_parts(s), "itl_split": s["itl_split"],
                     "gc_pauses": gc_pause_delta(gc_pauses(after), gc_pauses(before)), "cores_busy": busy,
                     "client_loop_busy": loops,
                     **{key: mean_ms_by_role(totals, wait_totals(before)[key])
                        for key, totals in wait_totals(after).items()}}
            point["meets_slo"] = meets(point, args)
            if args.step_times:
                point["decode_steps"] = decode_steps(after, before)
            if bound:
                point["apparatus_bound"] = bound
                print(f"# {label} {rate:g} req/s: measured through a saturated {', '.join(bound)}: "
                      "rerun with more --routers / --bench-clients", flush=True)
            if s["errors"]:
                point["errors"] = s["errors"][:5]
                for w in workers:
                    tail = "".join(w.log().splitlines(True)[-25:])
                    print(f"# {w.name} {w.args[-8:]}: last lines\n" + tail, flush=True)
            results.append(point)
            print(json.dumps(point), flush=True)
            write(results, args)
            if saturated(point, args):
                break
    finally:
        for router in routers:
            router.stop()
        for w in workers:
            w.stop()


def saturated(point: dict, args: argparse.Namespace) -> bool:
    """Past the layout's capacity: a request failed, it completed under 75 % of the offered rate (a short run's
    achieved rate counts its tail, the last requests' decode: 0.75, not 0.9), or its TTFT p90 passed 4× the SLO's."""
    return bool(point["failed"] or point["achieved_req_s"] < 0.75 * point["rate"]
                or point["ttft_p90_ms"] > 4 * args.slo_ttft_p90_ms)


def comparison(results: list[dict], args: argparse.Namespace) -> list[str]:
    """Each split against the best aggregated run (the highest SLO rate; the first on a tie): the ratio of their SLO
    rates, then at every rate both ran below saturation, ITL p99 (aggregated / split: above 1 is the split's gain),
    TTFT p90 (split / aggregated: above 1 is the split's loss) and output tok/s (split / aggregated)."""
    best = best_rates(results)
    aggregated = [label for label in best if _is_aggregated(results, label)]
    if not aggregated or len(aggregated) == len(best):
        return []
    peer = max(aggregated, key=best.__getitem__)  # (max keeps the first of equals)
    lines = ["", f"Against the best aggregated run ({peer}; ITL p99: aggregated / split, TTFT p90 and output tok/s: "
             "split / aggregated, at the rates both ran below saturation):", "",
             "| split | highest SLO rate (× aggregated) | rate (req/s) | ITL p99 gain | TTFT p90 | output tok/s |",
             "|" + " --- |" * 6]
    peer_points = {r["rate"]: r for r in results if r["label"] == peer and not saturated(r, args)}
    for label in best:
        if label in aggregated:
            continue
        ratio = f" ({best[label] / best[peer]:.2f}×)" if best[peer] else ""
        rate = f"{best[label]:g} against {best[peer]:g}" + ratio
        shared = [(r, peer_points[r["rate"]]) for r in results
                  if r["label"] == label and r["rate"] in peer_points and not saturated(r, args)]
        if not shared:
            lines.append(f"| {label} | {rate} | - | - | - | - |")
        for split, agg in shared:
            lines.append(f"| {label} | {rate} | {split['rate']:g} | {_ratio(agg['itl_p99_ms'], split['itl_p99_ms'])} | "
                         f"{_ratio(split['ttft_p90_ms'], agg['ttft_p90_ms'])} | "
                         f"{_ratio(split['output_tok_s'], agg['output_tok_s'])} |")
    return lines


def _is_aggregated(results: list[dict], label: str) -> bool:
    return any(r["label"] == label and Layout.parse(r["layout"]).prefill == 0 for r in results)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b else "-"


def best_rates(results: list[dict]) -> dict[str, float]:
    """Each run's (label's) highest rate that meets the SLO (0: none does)."""
    best: dict[str, float] = {}
    for r in results:
        best.setdefault(r["label"], 0.0)
        if r["meets_slo"]:
            best[r["label"]] = max(best[r["label"]], r["rate"])
    return best


def slo_goodput(point: dict) -> float:
    """The completed requests / s of a point that meets the SLO as a whole (its TTFT p90 and ITL p99), else 0."""
    return point["achieved_req_s"] if point["meets_slo"] else 0.0


def table(results: list[dict], args: argparse.Namespace) -> str:
    lines = [f"SLO: TTFT p90 <= {args.slo_ttft_p90_ms:g} ms and ITL p99 <= {args.slo_itl_p99_ms:g} ms; "
             f"input {args.input_len}, output {args.output_len}, {args.num_prompts} requests a point"
             + (f" (at least {args.point_s:g} s of arrivals)" if args.point_s else "") + ", Poisson", "",
             "| layout | rate (req/s) | achieved | output tok/s | TTFT mean / p90 (ms) | TPOT mean (ms) | ITL p99 (ms) "
             "| requests within TTFT, TPOT limits (req/s) | SLO | mean KV pull (ms) |", "|" + " --- |" * 10]
    for r in results:
        lines.append(f"| {r['label']} | {r['rate']:g} | {r['achieved_req_s']} | {r['output_tok_s']} | "
                     f"{r['ttft_mean_ms']} / {r['ttft_p90_ms']} | {r['tpot_mean_ms']} | {r['itl_p99_ms']} | "
                     f"{r['goodput_req_s']} | {'yes' if r['meets_slo'] else 'no'} | {r['kv_pull_mean_ms'] or '-'} |")
    bound = [f"{r['label']} at {r['rate']:g} ({', '.join(r['apparatus_bound'])})"
             for r in results if r.get("apparatus_bound")]
    if bound:
        lines += ["", "Measured through a saturated router or bench client (its one event loop delays what it relays "
                  "or times; more --routers / --bench-clients): " + "; ".join(bound) + "."]
    lines += ["", "Highest rate that meets the SLO: " + ", ".join(f"{k} {v:g}" for k, v in best_rates(results).items())]
    return "\n".join(lines + comparison(results, args))


def plot(results: list[dict], path: Path, args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(r["label"] for r in results):
        points = [r for r in results if r["label"] == label]
        ax.plot([p["rate"] for p in points], [slo_goodput(p) for p in points], marker="o", label=label)
    ax.set_xlabel("offered rate (req/s, Poisson)")
    ax.set_ylabel("SLO goodput (req/s; 0 where the point misses the SLO)")
    ax.set_title(f"SLO: TTFT p90 <= {args.slo_ttft_p90_ms:g} ms and ITL p99 <= {args.slo_itl_p99_ms:g} ms", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(results: list[dict], args: argparse.Namespace) -> None:
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "layouts"}
    config["layouts"] = [layout.name for layout in args.layouts]
    (args.out / "multi_gpu.json").write_text(json.dumps({"config": config, "runs": results}, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-from", type=Path, required=True)
    parser.add_argument("--shape", default="llama-3.2-3b", type=shape_arg,
                        help=f"one of {sorted(SHAPES)}, or a directory holding a config.json")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: write only the config; each worker makes random weights on its GPUs")
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "disagg-bench-models")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--layouts", type=lambda t: [Layout.parse(x) for x in t.split(",")], default=None,
                        help="default: N×aggregated and the splits for the GPUs visible (2: 1P1D; 4: 1P3D, 2P2D, "
                             "3P1D, tp2-1P2D)")
    parser.add_argument("--rates", type=lambda t: [float(x) for x in t.split(",")], default=[8, 16, 24, 32, 40, 48])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--point-s", type=float, default=0.0,
                        help="at least this many seconds of arrivals a point (more requests than --num-prompts at "
                             "high rates, so the tail weighs less in the achieved rate); 0: --num-prompts alone")
    parser.add_argument("--input-len", default="uniform:512:2048")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's temperature (0: greedy; 1: the OpenAI default, sampled on the device)")
    parser.add_argument("--slo-ttft-p90-ms", type=float, default=250.0)
    parser.add_argument("--slo-itl-p99-ms", type=float, default=15.0)
    parser.add_argument("--agg-chunks", type=lambda t: [int(x) for x in t.split(",")], default=[],
                        help="chunked-prefill sizes to try for the aggregated layouts (besides the default)")
    parser.add_argument("--only-agg-chunks", action="store_true",
                        help="the aggregated layouts at the --agg-chunks sizes alone, not at the default too")
    parser.add_argument("--queue-tokens", type=int, default=12288, help="+q layouts' --max-prefill-queue-tokens")
    parser.add_argument("--local-tokens", type=int, default=0,
                        help="+q layouts' --max-local-prefill-tokens (0: a prompt goes to the decode worker only while "
                             "the prefill queue is full)")
    parser.add_argument("--local-chunk", type=int, default=512,
                        help="+q layouts: the decode workers' step budget (--max-num-batched-tokens), so a prompt "
                             "they prefill themselves runs in chunks of at most this size beside their decode rows "
                             "(0: their default)")
    parser.add_argument("--routers", type=int, default=0,
                        help="router replicas over the same workers; the bench client sends request i to router i "
                             "mod N (one router's event loop streams about 7 000 tokens/s: see cores_busy; 0: one "
                             f"per {ROUTER_TOK_S} output tokens/s of the highest rate)")
    parser.add_argument("--bench-clients", type=int, default=0,
                        help="disagg bench's client processes (--clients): one times about 10 000 tokens/s at most "
                             f"(0: one per {CLIENT_TOK_S} output tokens/s of the highest rate)")
    parser.add_argument("--decode-streams", type=lambda t: t.split(","), default=["shared"],
                        help="the routers' --decode-streams, comma-separated: each layout runs with each "
                             "(shared,per-request compares the shared DecodeMany stream with a stream per request)")
    parser.add_argument("--max-num-seqs", type=int, default=0, help="every worker's --max-num-seqs (0: its default)")
    parser.add_argument("--prefill-budget", type=int, default=0,
                        help="prefill workers' --max-num-batched-tokens (0: their default)")
    parser.add_argument("--kv-blocks", type=int, default=8192,
                        help="each worker's pool (--num-kv-blocks); the run says when it holds fewer requests than a "
                             "worker admits")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-growth-reserve", type=int, default=None,
                        help="every worker's --kv-growth-reserve in tokens (default: theirs, 256; 0: admit while "
                             "blocks last)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting new points after this long")
    parser.add_argument("--step-times", action="store_true",
                        help="summarise each point's decode engine steps from the workers' metrics (see above)")
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    if args.layouts is None:
        splits = {2: ["1P1D"], 4: ["1P3D", "2P2D", "3P1D", "tp2-1P2D"]}.get(gpus, [f"1P{gpus - 1}D"])
        args.layouts = [Layout.parse(x) for x in (f"{gpus}xagg", *splits)]
    if set(args.decode_streams) - set(DECODE_STREAMS):
        parser.error(f"--decode-streams: each of {list(DECODE_STREAMS)}, got {args.decode_streams}")
    for layout in args.layouts:
        if layout.gpus > gpus:
            parser.error(f"layout {layout.name} needs {layout.gpus} GPUs; {gpus} visible")
    chosen = []
    if args.routers <= 0:
        args.routers = replicas(args.rates, args.output_len, ROUTER_TOK_S)
        chosen.append(f"{args.routers} router{'s' if args.routers > 1 else ''}")
    if args.bench_clients <= 0:
        args.bench_clients = replicas(args.rates, args.output_len, CLIENT_TOK_S)
        chosen.append(f"{args.bench_clients} bench client{'s' if args.bench_clients > 1 else ''}")
    if chosen:
        print(f"# {' and '.join(chosen)} for up to {max(args.rates):g} req/s x {args.output_len} output tokens "
              f"({max(args.rates) * args.output_len:,.0f} tok/s): one router's event loop streams about "
              f"{ROUTER_TOK_S} tok/s well inside a core", flush=True)
    if note := pool_note(args):
        print(note, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    model = model_dir(args.shape, args.tokenizer_from, args.models, args.load_format)
    results: list[dict] = []
    for layout in args.layouts:
        chunks = [*([] if args.only_agg_chunks else [None]), *args.agg_chunks] if layout.prefill == 0 else [None]
        for chunk, streams in ((c, m) for c in chunks for m in args.decode_streams):
            if time.monotonic() > deadline:
                break
            sweep(layout, chunk, model, args, results, deadline, streams)
    write(results, args)
    text = table(results, args)
    (args.out / "multi_gpu.md").write_text(text + "\n")
    print(text)
    if results:
        plot(results, args.out / "multi_gpu.png", args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

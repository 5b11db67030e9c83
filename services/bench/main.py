"""`disagg bench`: drive a running router with random prompts and report latency and throughput.

    disagg bench --num-prompts 200 --input-len uniform:100:1024 --output-len 128 --max-concurrency 16 \\
                 --goodput-ttft-ms 500 --goodput-tpot-ms 50 --json out.json --plot out.png
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

from common import tls
from common.errors import InvalidConfig
from services.bench.report import format_table, write_json, write_plot
from services.bench.runner import LoadShape, list_models, run_load
from services.bench.stats import SloLimits, summarize
from services.bench.workload import LengthDist, make_requests
from services.router.config import DEFAULT_PORT


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disagg bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router", default=os.environ.get("DISAGG_ROUTER", f"127.0.0.1:{DEFAULT_PORT}"))
    p.add_argument("--model", default="", help="model name (default: the router's first)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=LengthDist.parse, default=LengthDist.parse("uniform:64:512"),
                   help="prompt tokens: N, fixed:N, uniform:LOW:HIGH or normal:MEAN:STD")
    p.add_argument("--output-len", type=LengthDist.parse, default=LengthDist.parse("fixed:128"),
                   help="max_tokens per request, same forms as --input-len")
    p.add_argument("--token-range", type=int, nargs=2, default=(100, 10000), metavar=("LOW", "HIGH"),
                   help="random prompt token ids are drawn from [LOW, HIGH)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s of a Poisson arrival process (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not counted) before the run")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at EOS (by default every request generates its full output length)")
    p.add_argument("--goodput-ttft-ms", type=float, default=None, help="TTFT limit for goodput")
    p.add_argument("--goodput-tpot-ms", type=float, default=None, help="time-per-output-token limit for goodput")
    p.add_argument("--timeout", type=float, default=None, help="seconds per request before it counts as failed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the summary and per-request timings here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of the latency distributions here")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    tls.add_tls_args(p)
    return p


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    checks = [(args.num_prompts >= 1, "--num-prompts must be >= 1"),
              (args.request_rate > 0, "--request-rate must be > 0"),
              (args.max_concurrency is None or args.max_concurrency >= 1, "--max-concurrency must be >= 1"),
              (args.warmup >= 0, "--warmup must be >= 0"),
              (0 <= args.token_range[0] < args.token_range[1], "--token-range needs 0 <= LOW < HIGH")]
    for ok, message in checks:
        if not ok:
            parser.error(message)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr)


async def _bench(args: argparse.Namespace) -> int:
    models = (await list_models(args.router)).models
    info = next((m for m in models if m.id == args.model), models[0] if models and not args.model else None)
    if info is None:
        print(f"model {args.model!r} is not served by {args.router}: {[m.id for m in models]}", file=sys.stderr)
        return 1
    common = dict(token_range=tuple(args.token_range), max_model_len=info.max_model_len or None)
    requests = make_requests(args.num_prompts, args.input_len, args.output_len, seed=args.seed, **common)
    shape = LoadShape(args.request_rate, args.max_concurrency, args.seed)
    run_id = uuid.uuid4().hex[:8]
    kwargs = dict(model=info.id, temperature=args.temperature, ignore_eos=args.ignore_eos, timeout_s=args.timeout)
    if args.warmup:
        warm = make_requests(args.warmup, args.input_len, args.output_len, seed=args.seed + 10_000, **common)
        await run_load(args.router, warm, LoadShape(max_concurrency=args.max_concurrency), run_id=run_id + "-warm",
                       **kwargs)
    bar = _progress(len(requests), args.progress)
    try:
        records, duration = await run_load(args.router, requests, shape, run_id=run_id, progress=bar, **kwargs)
    finally:
        if bar is not None:
            bar.close()
    summary = summarize(records, duration, SloLimits(args.goodput_ttft_ms, args.goodput_tpot_ms))
    title = (f"{info.id}: {args.num_prompts} requests, in {args.input_len}, out {args.output_len}, "
             f"rate {args.request_rate:g}/s, concurrency {args.max_concurrency or 'unlimited'}")
    print(format_table(summary, "Serving Benchmark Result"))
    config = {k: (str(v) if isinstance(v, (Path, LengthDist)) else v) for k, v in vars(args).items()
              if not k.startswith("tls")}
    config.update(model=info.id, started_at_unix=time.time() - duration)
    if args.json:
        write_json(args.json, config, summary, records)
    if args.plot:
        write_plot(args.plot, summary, records, title)
    return 0 if summary.completed else 1


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _validate(args, parser)
    try:
        tls.configure(tls.tls_from_args(args))
    except InvalidConfig as exc:
        parser.error(str(exc))
    return asyncio.run(_bench(args))

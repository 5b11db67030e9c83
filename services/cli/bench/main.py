"""`disagg bench`: drive a running router with random prompts and report latency and throughput.

    disagg bench --num-prompts 200 --input-len uniform:100:1024 --output-len 128 --max-concurrency 16 \\
                 --goodput-ttft-ms 500 --goodput-tpot-ms 50 --json out.json --plot out.png
    disagg bench --api grpc,openai,kserve ...   # the same workload through each front door, compared

With several --api values the prompts are text (the random ids decoded by --tokenizer), so every front door,
KServe's text_input included, gets the same work: the same lengths and arrivals, with token ids of their own per
front door and round, so that no run hits the prefix cache of another. `--rounds N` alternates the front doors
N times (machine noise spreads over all of them) and reports each over all its rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time
import uuid
from pathlib import Path

import grpc

from common import tls
from common.errors import InvalidConfig
from services.cli.bench.clients import API_NAMES, SendOptions, make_client
from services.cli.bench.report import format_breakdown, format_comparison, format_table, write_json, write_plot
from services.cli.bench.runner import LoadShape, Sent, list_models, list_models_http, run_load
from services.cli.bench.spread import ClientSpec, run_spread
from services.cli.bench.stats import SloLimits, summarize
from services.cli.bench.workload import LengthDist, make_requests
from services.kit.auth import add_client_api_key_arg, client_key, grpc_metadata, http_headers
from common.heap import settle_heap
from services.router.config import DEFAULT_HTTP_PORT, DEFAULT_PORT


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disagg bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router", default=os.environ.get("DISAGG_ROUTER", f"127.0.0.1:{DEFAULT_PORT}"),
                   help="the router's gRPC address; several, comma-separated (router replicas over the same "
                        "workers: `disagg up --routers N`), take the requests in turn (--api grpc)")
    p.add_argument("--http", default=os.environ.get("DISAGG_HTTP", f"http://127.0.0.1:{DEFAULT_HTTP_PORT}"),
                   help="the router's OpenAI-compatible HTTP base URL (for --api openai)")
    p.add_argument("--api", type=_apis, default=("grpc",),
                   help=f"front doors to drive, comma-separated, in turn with the same workload: {', '.join(API_NAMES)}")
    p.add_argument("--rounds", type=int, default=1, help="times to run every --api in turn (alternating)")
    p.add_argument("--tokenizer", default=None,
                   help="model directory whose tokenizer turns the random ids into text prompts (default: the "
                        "default model); used with several --api values or kserve")
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
    p.add_argument("--clients", type=int, default=1,
                   help="client processes sending the workload (each every Nth request, on the same schedule): one "
                        "Python client times about 10 000 tokens/s at most; the concurrency limit is split over them")
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
    add_client_api_key_arg(p)
    tls.add_tls_args(p)
    return p


def _apis(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in API_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown API {unknown or text!r}; choose from {', '.join(API_NAMES)}")
    return names


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    checks = [(args.num_prompts >= 1, "--num-prompts must be >= 1"),
              (args.request_rate > 0, "--request-rate must be > 0"),
              (args.max_concurrency is None or args.max_concurrency >= 1, "--max-concurrency must be >= 1"),
              (args.warmup >= 0, "--warmup must be >= 0"),
              (args.rounds >= 1, "--rounds must be >= 1"),
              (args.clients >= 1, "--clients must be >= 1"),
              ("," not in args.router or "kserve" not in args.api,
               "several --router addresses (router replicas) are for --api grpc; KServe's client takes one"),
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
    # --api openai alone asks the HTTP server: any OpenAI-compatible one can be driven (benchmarks/vllm_cpu.py)
    key = client_key(args)
    try:
        listed = await (list_models_http(args.http, headers=http_headers(key)) if args.api == ("openai",)
                        else list_models(args.router.split(",")[0], grpc_metadata(key)))
    except grpc.aio.AioRpcError as exc:  # a wrong key, a router that is not there: one line, no traceback
        print(f"disagg bench: {args.router}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"disagg bench: {args.http}: {exc}", file=sys.stderr)
        return 1
    models = listed.models
    info = next((m for m in models if m.id == args.model), models[0] if models and not args.model else None)
    if info is None:
        print(f"model {args.model!r} is not served by {args.router}: {[m.id for m in models]}", file=sys.stderr)
        return 1
    common = dict(token_range=tuple(args.token_range), max_model_len=info.max_model_len or None)
    text = _text_prompts(args)
    run_id = uuid.uuid4().hex[:8]
    runs: dict[str, list[Sent]] = {api: [] for api in args.api}
    for round_ in range(args.rounds):
        for i, api in enumerate(args.api):
            content = None if len(args.api) == 1 and args.rounds == 1 else round_ * len(args.api) + i
            requests = text(make_requests(args.num_prompts, args.input_len, args.output_len, seed=args.seed,
                                          content_seed=content, **common))
            warm = text(make_requests(args.warmup, args.input_len, args.output_len, seed=args.seed + 10_000,
                                      content_seed=content, **common))
            options = SendOptions(info.id, args.temperature, args.ignore_eos, args.timeout, f"{run_id}-{api}-{round_}")
            runs[api].append(await _run_api(api, args, requests, warm, options))
    summaries = {}
    for api, done in runs.items():
        records = [r for sent in done for r in sent.records]
        duration = sum(sent.duration_s for sent in done)
        summaries[api] = summarize(records, duration, SloLimits(args.goodput_ttft_ms, args.goodput_tpot_ms),
                                   [busy for sent in done for busy in sent.loop_busy])
        title = (f"{info.id} via {api}: {args.num_prompts} requests x {args.rounds}, in {args.input_len}, "
                 f"out {args.output_len}, rate {args.request_rate:g}/s, concurrency {args.max_concurrency or 'unlimited'}")
        print(format_table(summaries[api], f"Serving Benchmark Result ({api})" if len(args.api) > 1
                           else "Serving Benchmark Result"))
        print(format_breakdown(summaries[api], api))
        _write(args, api, info.id, summaries[api], records, duration, title)
    if len(args.api) > 1:
        print(format_comparison(summaries))
    return 0 if all(s.completed for s in summaries.values()) else 1


def _text_prompts(args: argparse.Namespace):
    if len(args.api) == 1 and args.api != ("kserve",):
        return lambda requests: requests
    from common.engine.default_model import resolve_model
    from common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(resolve_model(args.tokenizer)))
    return lambda requests: [dataclasses.replace(r, prompt_text=tokenizer.decode(r.prompt_token_ids)) for r in requests]


async def _run_api(api: str, args: argparse.Namespace, requests, warm, options: SendOptions):
    client = make_client(api, args.router, args.http, args.max_concurrency, api_key=client_key(args))
    try:
        if warm:
            await run_load(client, warm, LoadShape(max_concurrency=args.max_concurrency),
                           dataclasses.replace(options, run_id=options.run_id + "-warm"))
        if args.clients > 1:
            spec = ClientSpec(api, args.router, args.http, args.max_concurrency, client_key(args), tls.current())
            return await asyncio.to_thread(run_spread, spec, requests, args.request_rate, args.seed, options,
                                           args.clients)
        bar = _progress(len(requests), args.progress)
        settle_heap()  # a collection over the client's start-up heap would be a gap in every stream it times
        try:
            return await run_load(client, requests, LoadShape(args.request_rate, args.max_concurrency, args.seed),
                                  options, progress=bar)
        finally:
            if bar is not None:
                bar.close()
    finally:
        await client.close()


def _write(args: argparse.Namespace, api: str, model: str, summary, records, duration: float, title: str) -> None:
    """--json / --plot, each named as written; with several APIs each file gets the API's name before its suffix."""
    config = {k: (str(v) if isinstance(v, (Path, LengthDist)) else v) for k, v in vars(args).items()
              if not k.startswith("tls") and k != "api_key"}  # the key never goes into a file
    config.update(model=model, api=api, started_at_unix=time.time() - duration)
    def path(p: Path) -> Path:
        return p if len(args.api) == 1 else p.with_name(f"{p.stem}-{api}{p.suffix}")
    if args.json:
        write_json(path(args.json), config, summary, records)
        print(f"wrote {path(args.json)} ({api}: the summary and every request's timings)")
    if args.plot:
        write_plot(path(args.plot), summary, records, title)
        print(f"wrote {path(args.plot)} ({api}: latency histograms)")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _validate(args, parser)
    try:
        tls.configure(tls.tls_from_args(args))
    except InvalidConfig as exc:
        parser.error(str(exc))
    return asyncio.run(_bench(args))

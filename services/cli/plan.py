"""`disagg plan`: the layout of this machine's devices that serves a workload best within an SLO, from the
engine's own measurements of the model here.

    disagg plan --workload "in=512-2048,out=128,rate=8" --slo ttft_p90=250ms,itl_p99=15ms [--save plan.json]
    disagg up --plan plan.json                       # starts the saved one
    disagg up --workload ... --slo ...               # plans, then starts the best

It profiles the model once per model, device and engine config (services/planner/profiler.py; the profile is cached
under the cache root's profiles/, keyed by a hash of the three), predicts every layout's TTFT, ITL and goodput with
a simulation over the profile (services/planner/predict.py) and prints the ranking. The engine flags are `disagg
up`'s (the same merge of --engine-config and --engine-overrides); docs/planner.md says what the figures mean.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from common.cpu_cores import usable_cores
from common.errors import InvalidConfig
from services.planner import profile as cache
from services.planner.layouts import Devices, Layout, layouts, load_plan, save_plan, units_needed
from services.planner.predict import DEFAULT_REQUESTS, Prediction, Predictor, format_ranking
from services.planner.profile import Profile, model_identity, profile_key
from services.planner.workload import parse_slo, parse_workload
from services.worker.engine_flags import add_engine_args, engine_config_from_args

_KEY_FIELDS_LEFT_OUT = ("device", "tensor_parallel_size", "gpu_memory_utilization")  # the unit sets them


def add_planning_args(g: argparse._ArgumentGroup, required: bool = False) -> None:
    """The flags `disagg plan` and `disagg up --workload/--slo` share."""
    g.add_argument("--workload", required=required, metavar="SPEC",
                   help='"in=512-2048,out=128,rate=8" (lengths: N, LOW-HIGH or a bench form) or a JSON file')
    g.add_argument("--slo", required=required, metavar="SPEC", help="ttft_p90=250ms,itl_p99=15ms (ttft, itl, e2e)")
    g.add_argument("--plan-tp-sizes", default="1", metavar="T,U",
                   help="CUDA: the TP sizes a worker may take (default 1)")
    g.add_argument("--plan-requests", type=int, default=DEFAULT_REQUESTS, metavar="N",
                   help=f"requests a simulated run (default {DEFAULT_REQUESTS})")
    g.add_argument("--plan-seed", type=int, default=0, metavar="N", help="the simulated requests' seed")
    g.add_argument("--profile-grid", default="", metavar="SPEC",
                   help="what to measure, over the device's default: 'lengths=64,256;batches=1,4;decode_batches=1,8;"
                        "contexts=64,512;max_tokens=8192;decode_steps=16;repeats=2'")
    g.add_argument("--reprofile", action="store_true", help="measure again, over the cached profile")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disagg plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_planning_args(p.add_argument_group("planning"), required=True)
    p.add_argument("--gpus", default=None, metavar="I,J", help="CUDA: the GPUs to plan for (default: all visible)")
    p.add_argument("--save", type=Path, default=None, metavar="FILE", help="write the best plan here (for up --plan)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the whole ranking here")
    p.add_argument("--top", type=int, default=None, metavar="N", help="print the first N layouts (default: all)")
    add_engine_args(p)
    return p


def devices_of(args: argparse.Namespace) -> Devices:
    """The GPUs (--gpus, else every visible one) with --device cuda; this process's cores on the CPU."""
    if str(args.device).startswith("cuda"):
        import torch

        visible = torch.cuda.device_count()
        if not visible:
            raise InvalidConfig("--device cuda, but no CUDA GPU is visible to this process; use --device cpu")
        gpus = args.gpus
        ids = tuple(int(g) for g in gpus.split(",")) if isinstance(gpus, str) else tuple(gpus or range(visible))
        return Devices("cuda", ids, torch.cuda.get_device_name(ids[0]))
    return Devices("cpu", usable_cores(), _cpu_name())


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def tp_sizes(args: argparse.Namespace) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(t) for t in str(args.plan_tp_sizes).split(",") if t.strip()}))
    except ValueError:
        raise InvalidConfig(f"--plan-tp-sizes takes sizes such as 1,2, got {args.plan_tp_sizes!r}") from None
    if not sizes or min(sizes) < 1:
        raise InvalidConfig(f"--plan-tp-sizes takes sizes >= 1, got {args.plan_tp_sizes!r}")
    return sizes


def engine_key_fields(config) -> dict:
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in _KEY_FIELDS_LEFT_OUT}
    return json.loads(json.dumps(fields, default=str))


def get_profile(args: argparse.Namespace, devices: Devices, units: list[str], log=print,
                directory: Path | None = None) -> Profile:
    """The cached profile of this model, device kind and engine config, or one measured now (and cached)."""
    from services.planner.profiler import Grid, profile_unit

    config = engine_config_from_args(args)
    engine = engine_key_fields(config)
    device = f"{devices.kind}: {devices.name}"
    key = profile_key(model_identity(config.model), device, engine, units)
    found = None if args.reprofile else cache.cached(key, directory)
    if found is not None:
        log(f"profile {key} from the cache ({cache.cache_dir() if directory is None else directory})")
        return found
    grid = Grid.parse(args.profile_grid, config.device)
    measured, limits = {}, None
    for unit in units:
        log(f"profiling {unit} on {device} (engine {config.engine}, {config.dtype})...")
        measured[unit], limits = profile_unit(config, unit, grid, log)
    profile = Profile(key, config.model, device, engine, limits, measured)
    log(f"profile {key} cached at {cache.store(profile, directory)}")
    return profile


def rank(args: argparse.Namespace, log=print) -> tuple[list[Prediction], Profile]:
    workload, slo = parse_workload(args.workload), parse_slo(args.slo)
    devices = devices_of(args)
    candidates = layouts(devices, workload, tp_sizes(args))
    profile = get_profile(args, devices, units_needed(candidates), log)
    for unit in sorted(profile.units):
        log(f"  {unit}: {profile.costs(unit).describe()}")
    predictor = Predictor(profile, workload, slo, args.plan_requests, args.plan_seed)
    return predictor.rank(candidates), profile


def plan_summary(args: argparse.Namespace, best: Prediction, profile: Profile) -> dict:
    return {"workload": parse_workload(args.workload).to_dict(), "slo": args.slo, "predicted": best.to_dict(),
            "profile": profile.key, "device": profile.device, "model": profile.model}


def best_layout(args: argparse.Namespace, log=print) -> tuple[Layout, str]:
    """The best layout for up's --workload and --slo, and one line on why (the summary's)."""
    ranking, _ = rank(args, log)
    best = ranking[0]
    runner_up = f"; next {ranking[1].layout.describe()} at {ranking[1].goodput:.2f} req/s" if len(ranking) > 1 else ""
    return best.layout, (f"{best.layout.describe()} by disagg plan: {best.goodput:.2f} req/s predicted within "
                         f"{args.slo}{runner_up} (docs/planner.md)")


def apply_layout(args: argparse.Namespace, layout: Layout, why: str) -> None:
    """Set up's layout flags from a plan: --prefill, --decode, the local-prefill threshold (unless given) and the TP
    size. A plan and --prefill/--decode both choosing is an error: one of them would be ignored."""
    if args.prefill is not None or args.decode is not None:
        raise InvalidConfig("--plan and --workload/--slo choose --prefill and --decode; leave those out, or the plan")
    args.prefill, args.decode = layout.prefill, layout.decode
    if layout.prefill and args.max_local_prefill_tokens is None:
        args.max_local_prefill_tokens = layout.max_local_prefill_tokens
    if layout.tensor_parallel_size > 1:
        args.tensor_parallel_size = layout.tensor_parallel_size
    args.planned_why = why


def check_up_planning(args: argparse.Namespace) -> None:
    """up's planning flags together: --workload with --slo, --plan without them, --planner with an SLO to judge by
    and the router's metrics to read."""
    if args.plan and args.workload:
        raise InvalidConfig("--plan starts a saved layout and --workload plans one; give one of them")
    if bool(args.workload) != bool(args.slo) and not (args.planner and args.slo):
        raise InvalidConfig("--workload and --slo plan the layout together; give both (--planner takes --slo alone)")
    if args.planner and not args.slo:
        raise InvalidConfig("--planner judges the router's TTFT and ITL against --slo; give --slo")
    if args.planner and args.metrics_port_base == -1:
        raise InvalidConfig("--planner reads the router's metrics; --metrics-port-base -1 turns them off")
    if args.planner and (args.planner_min_decode < 1 or args.planner_min_prefill < 0):
        raise InvalidConfig("--planner-min-decode must be >= 1 and --planner-min-prefill >= 0")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        ranking, profile = rank(args, lambda m: print(m, file=sys.stderr, flush=True))
    except (InvalidConfig, ValueError) as exc:
        print(f"disagg plan: error: {exc}", file=sys.stderr)
        return 2
    workload, slo = parse_workload(args.workload), parse_slo(args.slo)
    print(format_ranking(ranking, slo, workload, args.top))
    best = ranking[0]
    print(f"\nbest: {best.layout.describe()}: disagg up {' '.join(best.layout.up_flags())}")
    if args.save:
        save_plan(args.save, best.layout, plan_summary(args, best, profile))
        print(f"wrote {args.save} (disagg up --plan {args.save})")
    if args.json:
        args.json.write_text(json.dumps({**plan_summary(args, best, profile),
                                         "ranking": [p.to_dict() for p in ranking]}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0

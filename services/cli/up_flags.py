"""`disagg up`'s flags. `--help` shows the ones a first run needs, a line each; `--help-all` every one: the router's
routing flags and the engine flags, which up passes on to its children, and the layout, ports and limits of up's own.
"""
from __future__ import annotations

import argparse

from common import tls
from services.cli.kv_tiers import add_kv_tier_args
from services.cli.placement import parse_gpus
from services.kit.auth import add_api_key_args
from services.router.config import DEFAULT_HTTP_PORT, DEFAULT_PORT, add_routing_args
from services.worker.engine_flags import add_engine_args
from services.worker.handoff_flags import add_pull_args, add_transport_args

# Workers sharing a GPU (one GPU, or --share-gpus): a remote prefill pays against aggregated serving (output tok/s,
# TTFT, ITL p99) from about this prompt length on, the crossover benchmarks/disagg_sweep.py finds.
ONE_GPU_MAX_LOCAL_PREFILL_TOKENS = 1536
# Every worker on GPUs of its own: every prompt remote. A prompt prefilled on the decode GPU takes its step from every
# running decode, so local prefills raise decode's ITL tail past its SLO while the prefill GPU has room.
SEPARATE_GPUS_MAX_LOCAL_PREFILL_TOKENS = 0

# What `--help` shows; `--help-all` shows every flag.
SHOWN = {"help", "help_all", "model", "device", "dtype", "prefill", "decode", "gpus", "host", "router_port",
         "http_port", "routers", "policy", "tool_call_parser", "reasoning_parser", "engine_config", "engine_overrides",
         "prefill_engine_overrides", "decode_engine_overrides", "tensor_parallel_size", "max_num_seqs",
         "num_kv_blocks", "gpu_memory_utilization", "api_key", "api_key_file", "tls_cert", "tls_key", "tls_ca",
         "log_level", "plan"}

DESCRIPTION = """\
A router, prefill and decode workers on this machine until Ctrl-C; a child that
dies is restarted on its ports. Engine flags go to every worker (defaults <
YAML < JSON < flags given); --prefill-/--decode-engine-overrides to one role's."""


class _HelpAll(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: object):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        build_parser(show_all=True).print_help()
        parser.exit()


def build_parser(show_all: bool = False) -> argparse.ArgumentParser:
    """Every flag of `disagg up`; without `show_all`, those outside SHOWN hidden from --help (still accepted)."""
    parser = argparse.ArgumentParser(prog="disagg up", usage="%(prog)s [flags]", description=DESCRIPTION,
                                     formatter_class=_formatter)
    parser.add_argument("--help-all", action=_HelpAll, help="show every flag (this list: the common ones)")
    _add_layout_args(parser.add_argument_group("layout and ports"))
    routing = parser.add_argument_group("routing (the router's flags)")
    add_routing_args(routing)
    routing.add_argument("--max-local-prefill-tokens", type=int, default=None,
                         help=f"prompts this short prefill on decode (default: {ONE_GPU_MAX_LOCAL_PREFILL_TOKENS} "
                              f"sharing a GPU, else {SEPARATE_GPUS_MAX_LOCAL_PREFILL_TOKENS})")
    _add_role_args(parser.add_argument_group("per role"))
    _add_planner_args(parser.add_argument_group("planning (docs/planner.md)"))
    _add_worker_args(parser.add_argument_group("workers (passed on to each)"))
    add_kv_tier_args(parser.add_argument_group("KV cache tiers"))
    add_engine_args(parser)
    add_api_key_args(parser)
    tls.add_tls_args(parser)
    if not show_all:
        _hide_rare(parser)
    return parser


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32)


def _add_layout_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill workers (0: aggregated; default 1)")
    g.add_argument("--decode", type=int, default=None, metavar="N",
                   help="decode workers (default 1; CUDA: a GPU each)")
    g.add_argument("--gpus", type=_gpus, default=None, metavar="I,J",
                   help="CUDA: the GPUs to use, in order (default: all)")
    g.add_argument("--share-gpus", action="store_true",
                   help="CUDA: more GPU ranks than GPUs share them round-robin")
    g.add_argument("--routers", type=int, default=None, metavar="N",
                   help="routers on the same ports (default: as many as the workers' measured decode rate needs)")
    g.add_argument("--host", default="127.0.0.1", help="address every process binds")
    g.add_argument("--router-port", type=int, default=DEFAULT_PORT, metavar="PORT",
                   help=f"gRPC port (default {DEFAULT_PORT}; 0: a free one)")
    g.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT, metavar="PORT",
                   help=f"OpenAI HTTP port (default {DEFAULT_HTTP_PORT}; 0: off)")
    g.add_argument("--metrics-port-base", type=int, default=0, metavar="N",
                   help="/metrics on N, N+1, ... (default 0: free ports; -1: off)")
    g.add_argument("--start-timeout", type=float, default=600.0, metavar="S",
                   help="seconds each process may take to start")
    g.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    g.add_argument("--no-cpu-pinning", action="store_true",
                   help="CPU: no cores of its own for each worker's model")


def _add_role_args(g: argparse._ArgumentGroup) -> None:
    for role in ("prefill", "decode"):
        g.add_argument(f"--{role}-tensor-parallel-size", type=int, default=None, metavar="N",
                       help=f"{role} workers' TP size (default: --tensor-parallel-size)")
        g.add_argument(f"--{role}-engine-overrides", metavar="JSON", default=None,
                       help=f"{role} workers' engine flags, over the files")


def _add_planner_args(g: argparse._ArgumentGroup) -> None:
    from services.cli.plan import add_planning_args  # (imports no engine: the profiler loads when it runs)

    g.add_argument("--plan", default=None, metavar="FILE", help="start the layout `disagg plan --save` wrote")
    add_planning_args(g)
    g.add_argument("--planner", action="store_true",
                   help="move workers between roles at run time by the router's metrics against --slo")
    g.add_argument("--planner-interval", type=float, default=10.0, metavar="S",
                   help="seconds a window of the router's metrics (default 10)")
    g.add_argument("--planner-windows", type=int, default=3, metavar="N",
                   help="windows in a row that must want the same move (default 3)")
    g.add_argument("--planner-cooldown", type=float, default=60.0, metavar="S",
                   help="seconds after a move before the next (default 60)")
    g.add_argument("--planner-ratio", type=float, default=1.5, metavar="X",
                   help="a role's SLO pressure over the other's that wants a move (default 1.5)")
    g.add_argument("--planner-min-prefill", type=int, default=0, metavar="N",
                   help="prefill workers kept at least (default 0: aggregated)")
    g.add_argument("--planner-min-decode", type=int, default=1, metavar="N",
                   help="decode workers kept at least (default 1)")


def _add_worker_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--model-name", default=None, metavar="NAME", help="the model's name for clients (default: from --model)")
    add_transport_args(g)
    add_pull_args(g)  # the decode workers'


def _hide_rare(parser: argparse.ArgumentParser) -> None:
    """Flags outside SHOWN leave --help; a group left empty leaves it too, with its description."""
    for action in parser._actions:
        if action.dest not in SHOWN:
            action.help = argparse.SUPPRESS
    for group in parser._action_groups:
        if all(a.help == argparse.SUPPRESS for a in group._group_actions):
            group.title, group.description = None, None


def _gpus(text: str) -> tuple[int, ...]:
    try:
        return parse_gpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None

"""`disagg up`: router + prefill + decode workers on this machine, as child processes, until Ctrl-C.

Workers bind free ports; the router binds --router-port (50051, what `disagg generate` expects).
Engine flags (--model, --dtype, --device, --block-size, --num-kv-blocks, --gpu-memory-utilization,
--max-num-seqs, ...) go to every worker. Each child's log lines are echoed with its name; a child
that dies is restarted on its port with a back-off, so the cluster keeps serving. Each child serves
Prometheus /metrics on a port of its own, kept across its restarts: free ones, or with --metrics-port-base N
router N, then prefill-0.. and decode-0.. on N+1, N+2, ... (a Prometheus scrape list stays right). Ctrl-C or
SIGTERM stops them all (SIGTERM, then SIGKILL after a grace period).
"""
from __future__ import annotations

import argparse
import errno
import signal
import socket
import sys
import time

from common import tls
from common.engine.start import check_startable
from common.errors import InvalidConfig
from services.worker.engine_flags import add_engine_args, engine_argv, engine_config_from_args
from services.router import policies
from services.router.config import DEFAULT_HTTP_PORT, DEFAULT_PORT
from services.cli.supervise import Child, log, stop_all, wait_ready


def _bind_problem(host: str, port: int) -> str | None:
    """None if host:port can be bound now, else what stops it."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            return "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
    return None


def check_port_free(host: str, port: int, flag: str = "--router-port") -> str | None:
    """None if host:port can be bound now, else a one-line reason naming the flag."""
    problem = _bind_problem(host, port) if port else None
    if problem:
        hint = "0 picks a free one" if flag == "--router-port" else "0 turns it off"
        return f"{host}:{port} {problem}; choose another port with {flag} ({hint})"
    return None


def child_names(args: argparse.Namespace) -> list[str]:
    """Every child, in the order metrics ports are handed out: router, prefill-0.., decode-0.."""
    return ["router", *(f"{role}-{i}" for role, count in (("prefill", args.prefill), ("decode", args.decode))
                        for i in range(count))]


def metrics_ports(args: argparse.Namespace) -> dict[str, int]:
    """Each child's --metrics-port: base, base+1, ... in child_names order; 0 (a free one) for base 0, -1 (off) for -1."""
    base = args.metrics_port_base
    return {name: (0 if not base else -1 if base < 0 else base + i) for i, name in enumerate(child_names(args))}


def check_metrics_ports(args: argparse.Namespace) -> str | None:
    """With --metrics-port-base: None if every port of its range is free and apart from the router's, else one line."""
    if args.metrics_port_base <= 0:
        return None
    ports = metrics_ports(args)
    span = f"--metrics-port-base {args.metrics_port_base} gives ports {min(ports.values())}-{max(ports.values())}"
    for flag, port in (("--router-port", args.router_port), ("--http-port", args.http_port)):
        if port in ports.values():
            return f"{span} ({len(ports)} services), which include {flag} {port}; choose another base"
    for name, port in ports.items():
        problem = _bind_problem(args.host, port)
        if problem:
            return f"{args.host}:{port} ({name}'s metrics port) {problem}; choose another --metrics-port-base " \
                   "(or leave it out: free ports)"
    return None


def tp_sizes(args: argparse.Namespace) -> dict[str, int]:
    """Each worker role's tensor-parallel size: its own flag, else --tensor-parallel-size."""
    return {role: getattr(args, f"{role}_tensor_parallel_size") or args.tensor_parallel_size
            for role in ("prefill", "decode")}


def start_cluster(args: argparse.Namespace) -> list[Child]:
    """Workers first (their addresses go to the router's flags), then the router; all SERVING on return."""
    worker_args = ["--host", args.host, "--log-level", args.log_level, *engine_argv(args)]
    ports = metrics_ports(args)
    sizes, workers = tp_sizes(args), []
    for name in child_names(args)[1:]:
        role = name.split("-")[0]
        workers.append(Child.start(name, f"services.{role}", [*worker_args, "--tensor-parallel-size", str(sizes[role]),
                                                              "--metrics-port", str(ports[name])]))
    children = list(workers)
    try:
        wait_ready(workers, args.start_timeout)
        addresses = {role: ",".join(c.address for c in workers if c.name.startswith(role))
                     for role in ("prefill", "decode")}
        router_args = ["--host", args.host, "--port", str(args.router_port), "--http-port", str(args.http_port),
                       "--model", args.model or "default",
                       "--decode-workers", addresses["decode"], "--policy", args.policy,
                       "--min-remote-prefill-tokens", str(args.min_remote_prefill_tokens),
                       "--max-local-prefill-tokens", str(args.max_local_prefill_tokens),
                       "--max-prefill-queue-tokens", str(args.max_prefill_queue_tokens), "--log-level", args.log_level,
                       "--metrics-port", str(ports["router"])]
        if addresses["prefill"]:
            router_args += ["--prefill-workers", addresses["prefill"]]
        children.insert(0, Child.start("router", "services.router", router_args))
        wait_ready(children[:1], args.start_timeout)
    except BaseException:
        stop_all(children)
        raise
    return children


def _banner(children: list[Child], host: str, http_port: int) -> str:
    router = children[0].address
    workers = "\n".join(f"  {c.name:<10} {c.address}  (gRPC: Worker, Prefiller/Decoder, TensorStore)" for c in children[1:])
    metrics = "\n".join(f"  {c.name:<10} {c.metrics_url}" for c in children if c.metrics_url)
    http = f"http://{host}:{http_port}" if http_port else None
    http_lines = (f"""  curl -N {http}/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{{"messages": [{{"role": "user", "content": "Hi!"}}], "stream": true}}'
""" if http else "")
    return f"""
disagg is up: router on {router} (gRPC: disagg.v1.Generation, KServe v2 inference.GRPCInferenceService)
{f"  OpenAI-compatible HTTP on {http}/v1" if http else "  OpenAI-compatible HTTP off (--http-port 0)"}
{workers}
{f"Prometheus /metrics (kept across restarts):{chr(10)}{metrics}" if metrics else "Prometheus /metrics off"}

  disagg generate "Tell me about the sea" --router {router}
  grpcurl -plaintext {router} list
  grpcurl -plaintext -d '{{"prompt": "The sea is", "sampling": {{"max_tokens": 32, "temperature": 0}}}}' \\
      {router} disagg.v1.Generation/Generate
{http_lines}
A process that dies is restarted. Ctrl-C stops everything.
"""


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops everything the way Ctrl-C does


def _ignore_more_interrupts() -> None:
    """While the children stop: a second Ctrl-C or SIGTERM (a supervisor's, a shell's) must not cut the stop short
    and leave them running; stop_all's own deadlines bound it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


# Every worker of `disagg up --device cuda` shares one GPU. There, a remote prefill pays (issue #24's targets against
# aggregated: ≥ 0.9× output tok/s, TTFT mean ≤ 1.5×, ITL p99 ≥ 2× better) from about this prompt length on: the
# crossover tests/bench/disagg_sweep.py measured (README, "When disaggregation pays").
ONE_GPU_MAX_LOCAL_PREFILL_TOKENS = 1536


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="disagg up", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--router-port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                        help=f"the router's OpenAI-compatible HTTP port (default {DEFAULT_HTTP_PORT}; 0 turns it off)")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (0: aggregated on decode)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--policy", default="round_robin", choices=policies.names())
    parser.add_argument("--min-remote-prefill-tokens", type=int, default=0)
    parser.add_argument("--max-local-prefill-tokens", type=int, default=None,
                        help="prompts with at most this many uncached tokens prefill on the decode worker (default: "
                             f"{ONE_GPU_MAX_LOCAL_PREFILL_TOKENS} on a GPU, where every worker shares it; 0 elsewhere)")
    parser.add_argument("--max-prefill-queue-tokens", type=int, default=0,
                        help="prefill tokens queued on a prefill worker before prompts stay on decode (0: no limit)")
    parser.add_argument("--metrics-port-base", type=int, default=0,
                        help="Prometheus /metrics ports: router on N, then prefill-0.., decode-0.. on N+1, ... "
                             "(default 0: free ports; -1 turns metrics off); each kept across restarts")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds each process may take to start")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    for role in ("prefill", "decode"):
        parser.add_argument(f"--{role}-tensor-parallel-size", type=int, default=None,
                            help=f"{role} workers' tensor-parallel size (default: --tensor-parallel-size); prefill "
                                 "and decode may differ: a session moves with every KV head")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.decode < 1 or args.prefill < 0:
        parser.error("--decode must be >= 1 and --prefill >= 0")
    if args.max_local_prefill_tokens is None:
        args.max_local_prefill_tokens = ONE_GPU_MAX_LOCAL_PREFILL_TOKENS if args.device.startswith("cuda") else 0
    if not -1 <= args.metrics_port_base <= 65535 - len(child_names(args)):
        parser.error(f"--metrics-port-base must be -1 or 0..{65535 - len(child_names(args))}, "
                     f"got {args.metrics_port_base}")
    return args


def preflight(args: argparse.Namespace) -> str | None:
    """What would stop the cluster, found before any process loads a model: one line, or None."""
    busy = (check_port_free(args.host, args.router_port) or check_port_free(args.host, args.http_port, "--http-port")
            or check_metrics_ports(args))
    if busy:
        return busy
    try:
        config = engine_config_from_args(args)  # the model resolves (the default one is converted once, here)
        for role, size in tp_sizes(args).items():  # and every flag holds, before any process loads the model
            if args.prefill or role == "decode":
                check_startable(config.replace(tensor_parallel_size=size))
        tls.configure(tls.tls_from_args(argparse.Namespace()))  # DISAGG_TLS_*, which the children inherit too
    except (InvalidConfig, ValueError, FileNotFoundError) as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = preflight(args)
    if problem:
        log(problem)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    children: list[Child] = []
    try:
        children = start_cluster(args)
        print(_banner(children, args.host, args.http_port), flush=True)
        while True:
            now = time.monotonic()
            for child in children:
                child.supervise(now)
            time.sleep(0.2)
    except KeyboardInterrupt:
        print("\nstopping...", file=sys.stderr)
        return 0
    except RuntimeError as exc:
        log(f"failed: {exc}")
        return 1
    finally:
        _ignore_more_interrupts()
        stop_all(children)

"""`disagg up`: router + prefill + decode workers on this machine, as child processes, until Ctrl-C.

Workers bind free ports; the router binds --router-port (50051, what `disagg generate` expects).
Engine flags (--model, --dtype, --device, --block-size, --num-kv-blocks, --gpu-memory-utilization,
--max-num-seqs, ...) go to every worker. Each child's log lines are echoed with its name; a child
that dies is restarted on its port with a back-off, so the cluster keeps serving. Ctrl-C or SIGTERM
stops them all (SIGTERM, then SIGKILL after a grace period).
"""
from __future__ import annotations

import argparse
import errno
import signal
import socket
import sys
import time

from common import tls
from common.errors import InvalidConfig
from services.engine_flags import add_engine_args, engine_argv, engine_config_from_args
from services.router.config import DEFAULT_HTTP_PORT, DEFAULT_PORT, POLICY_NAMES
from services.supervise import Child, log, stop_all, wait_ready


def check_port_free(host: str, port: int, flag: str = "--router-port") -> str | None:
    """None if host:port can be bound now, else a one-line reason naming the flag."""
    if port == 0:
        return None
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            what = "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            hint = "0 picks a free one" if flag == "--router-port" else "0 turns it off"
            return f"{host}:{port} {what}; choose another port with {flag} ({hint})"
    return None


def start_cluster(args: argparse.Namespace) -> list[Child]:
    """Workers first (their addresses go to the router's flags), then the router; all SERVING on return."""
    worker_args = ["--host", args.host, "--log-level", args.log_level, *engine_argv(args)]
    workers = [Child.start(f"{role}-{i}", f"services.{role}", worker_args)
               for role, count in (("prefill", args.prefill), ("decode", args.decode)) for i in range(count)]
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
                       "--max-prefill-queue-tokens", str(args.max_prefill_queue_tokens), "--log-level", args.log_level]
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
    http = f"http://{host}:{http_port}" if http_port else None
    http_lines = (f"""  curl -N {http}/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{{"messages": [{{"role": "user", "content": "Hi!"}}], "stream": true}}'
""" if http else "")
    return f"""
disagg is up: router on {router} (gRPC: disagg.v1.Generation, KServe v2 inference.GRPCInferenceService)
{f"  OpenAI-compatible HTTP on {http}/v1" if http else "  OpenAI-compatible HTTP off (--http-port 0)"}
{workers}

  disagg generate "Tell me about the sea" --router {router}
  grpcurl -plaintext {router} list
  grpcurl -plaintext -d '{{"prompt": "The sea is", "sampling": {{"max_tokens": 32, "temperature": 0}}}}' \\
      {router} disagg.v1.Generation/Generate
{http_lines}
A process that dies is restarted. Ctrl-C stops everything.
"""


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops everything the way Ctrl-C does


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="disagg up", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--router-port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                        help=f"the router's OpenAI-compatible HTTP port (default {DEFAULT_HTTP_PORT}; 0 turns it off)")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (0: aggregated on decode)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--policy", default="round_robin", choices=POLICY_NAMES)
    parser.add_argument("--min-remote-prefill-tokens", type=int, default=0)
    parser.add_argument("--max-local-prefill-tokens", type=int, default=0,
                        help="prompts with at most this many uncached tokens prefill on the decode worker")
    parser.add_argument("--max-prefill-queue-tokens", type=int, default=0,
                        help="prefill tokens queued on a prefill worker before prompts stay on decode (0: no limit)")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds each process may take to start")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.decode < 1 or args.prefill < 0:
        parser.error("--decode must be >= 1 and --prefill >= 0")
    return args


def preflight(args: argparse.Namespace) -> str | None:
    """What would stop the cluster, found before any process loads a model: one line, or None."""
    busy = check_port_free(args.host, args.router_port) or check_port_free(args.host, args.http_port, "--http-port")
    if busy:
        return busy
    try:
        engine_config_from_args(args)  # the model resolves (the default one is converted once, here) and flags hold
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
        stop_all(children)

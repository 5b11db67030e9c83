"""`disagg up`: router + prefill + decode workers on this machine, as child processes, until Ctrl-C.

Workers bind free ports; the router binds --router-port (50051, what `disagg generate` expects).
Each child's log lines are echoed with its name; if one exits, or on Ctrl-C / SIGTERM, all of
them are stopped (SIGTERM, then SIGKILL after a grace period).
"""
from __future__ import annotations

import argparse
import collections
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import channels, tls
from services.router.config import DEFAULT_PORT

_READY_LINE = re.compile(r"disagg-(\w+) serving on (\S+)")
_STOP_GRACE_S = 15.0


@dataclass
class Child:
    """One service process; a thread echoes its output and notes the address it announces."""

    name: str
    process: subprocess.Popen
    echo: bool = True
    address: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))

    @classmethod
    def start(cls, name: str, module: str, args: list[str], echo: bool = True) -> "Child":
        process = subprocess.Popen([sys.executable, "-u", "-m", module, *args], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        child = cls(name, process, echo)
        threading.Thread(target=child._pump, name=f"{name}-output", daemon=True).start()
        return child

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.tail.append(line)
            match = _READY_LINE.search(line)
            if match and not self.ready.is_set():
                self.address = match.group(2)
                self.ready.set()
            elif self.echo:
                sys.stderr.write(f"[{self.name}] {line}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)


def wait_ready(children: list[Child], timeout_s: float) -> None:
    """Until every child announced its address and answers health SERVING; RuntimeError if one dies."""
    deadline = time.monotonic() + timeout_s
    for child in children:
        while not child.ready.wait(0.1):
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.name} exited with code {child.process.returncode}:\n"
                                   + "".join(child.tail))
            if time.monotonic() > deadline:
                raise RuntimeError(f"{child.name} did not start within {timeout_s:.0f}s:\n" + "".join(child.tail))
        _check_health(child, deadline)


def _check_health(child: Child, deadline: float) -> None:
    with channels.sync_channel(child.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{child.name} at {child.address} is not SERVING")
            time.sleep(0.1)


def stop_all(children: list[Child], grace_s: float = _STOP_GRACE_S) -> None:
    for child in children:
        child.stop()
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


def _engine_args(args: argparse.Namespace) -> list[str]:
    out = ["--host", args.host, "--model", args.model, "--dtype", args.dtype, "--device", args.device,
           "--log-level", args.log_level]
    if args.num_kv_blocks is not None:
        out += ["--num-kv-blocks", str(args.num_kv_blocks)]
    return out


def start_cluster(args: argparse.Namespace) -> list[Child]:
    """Workers first (their addresses go to the router's flags), then the router; all SERVING on return."""
    workers = [Child.start(f"{role}-{i}", f"services.{role}", _engine_args(args))
               for role, count in (("prefill", args.prefill), ("decode", args.decode)) for i in range(count)]
    children = list(workers)
    try:
        wait_ready(workers, args.start_timeout)
        addresses = {role: ",".join(c.address for c in workers if c.name.startswith(role))
                     for role in ("prefill", "decode")}
        router_args = ["--host", args.host, "--port", str(args.router_port), "--model", args.model,
                       "--decode-workers", addresses["decode"], "--policy", args.policy,
                       "--min-remote-prefill-tokens", str(args.min_remote_prefill_tokens), "--log-level", args.log_level]
        if addresses["prefill"]:
            router_args += ["--prefill-workers", addresses["prefill"]]
        children.insert(0, Child.start("router", "services.router", router_args))
        wait_ready(children[:1], args.start_timeout)
    except BaseException:
        stop_all(children)
        raise
    return children


def _banner(router: str) -> str:
    return f"""
disagg is up: router on {router}

  disagg generate "Tell me about the sea" --router {router}
  grpcurl -plaintext {router} list
  grpcurl -plaintext -d '{{"prompt": "The sea is", "sampling": {{"max_tokens": 32, "temperature": 0}}}}' \\
      {router} disagg.v1.Generation/Generate

Ctrl-C stops everything.
"""


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops everything the way Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg up", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="model directory or 'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--router-port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (0: aggregated on decode)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--policy", default="round_robin", choices=["round_robin", "least_loaded"])
    parser.add_argument("--min-remote-prefill-tokens", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds each process may take to start")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    if args.decode < 1 or args.prefill < 0:
        parser.error("--decode must be >= 1 and --prefill >= 0")
    tls.configure(tls.tls_from_args(argparse.Namespace()))  # DISAGG_TLS_*, which the children inherit too
    signal.signal(signal.SIGTERM, _interrupt)
    children: list[Child] = []
    try:
        children = start_cluster(args)
        print(_banner(children[0].address), flush=True)
        while all(c.process.poll() is None for c in children):
            time.sleep(0.2)
        dead = next(c for c in children if c.process.poll() is not None)
        print(f"{dead.name} exited with code {dead.process.returncode}; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping...", file=sys.stderr)
        return 0
    except RuntimeError as exc:
        print(f"disagg up failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all(children)

"""Real service processes for the benchmarks and the integration tests (tests.integration.processes: these).

    proc = start_service("prefill", "--model", model_dir)   # port 0, waits for health SERVING
    try:
        channel = grpc.insecure_channel(proc.address)
        ...
    finally:
        proc.stop()                                         # SIGTERM, then SIGKILL; returns the exit code

`start_service(role, *args, env=None)` runs `python -m services.<role> --port 0 *args`,
reads the `disagg-<role> serving on HOST:PORT` line from its stdout and waits until
grpc.health.v1 says SERVING. `ServiceProcess.spawn` + `wait_ready` start several at once.
Every process is stopped by whoever started it; nothing here outlives a `finally`.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.tls import tls_from_args

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVING_LINE = re.compile(r"^disagg-(?P<role>[\w-]+) serving on (?P<address>\S+)(?: \(.*\))?$")
METRICS_LINE = re.compile(r"^disagg-[\w-]+ metrics on http://(?P<address>\S+)/metrics$")
HTTP_LINE = re.compile(r"^disagg-router OpenAI-compatible HTTP on (?P<url>https?://\S+)/v1$")
DEFAULT_START_TIMEOUT_S = 120.0


def last_segment(line: str) -> str:
    """What a terminal would show of `line`: after its last carriage return. A tensor-parallel worker's follower
    ranks share its output, and their progress bars end in \r, not \n: the serving line can follow one on the
    same line (a TP worker's start then looked hung to a test waiting for that line)."""
    return line.strip().rsplit("\r", 1)[-1].strip()


class ServiceProcess:
    """One `python -m services.<role>` subprocess; its stdout and stderr are kept for `log()`."""

    def __init__(self, role: str, args: tuple[str, ...], popen: subprocess.Popen, env: Mapping[str, str]):
        self.role = role
        self.args = args
        self.popen = popen
        self.env = env
        self.address: str | None = None  # host:port from the serving line
        self._lines: list[str] = []
        self._announced = threading.Event()  # the serving line arrived, or the output ended
        self._reader = threading.Thread(target=self._read_output, name=f"{role}-output", daemon=True)
        self._reader.start()

    @classmethod
    def spawn(cls, role: str, *args: str, env: Mapping[str, str] | None = None,
              prefix: tuple[str, ...] = ()) -> "ServiceProcess":
        """Start the process without waiting; call `wait_ready` (and always `stop`). `prefix`: a command it runs
        under that execs it (`ip netns exec NS`: the pid stays python's)."""
        # A router serves no HTTP unless the test asks for a port (then that flag alone): tests start many routers.
        http_off = ("--http-port", "0") if role == "router" and "--http-port" not in args else ()
        command = [*prefix, sys.executable, "-m", f"services.{role}", "--port", "0", *http_off, *args]
        full_env = {**os.environ, **(env or {})}
        popen = subprocess.Popen(command, cwd=REPO_ROOT, env=full_env, text=True,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return cls(role, tuple(args), popen, full_env)

    @property
    def name(self) -> str:
        return f"disagg-{self.role} (pid {self.popen.pid})"

    def wait_ready(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Until the serving line is printed and health is SERVING; RuntimeError with the log otherwise."""
        if not self._announced.wait(timeout_s) or self.address is None:
            raise RuntimeError(f"{self.name} did not announce its port within {timeout_s:g}s "
                               f"(exit code {self.popen.poll()}):\n{self.log()}")
        with self.channel() as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=True)
        if response.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"{self.name} announced {self.address} but is not SERVING:\n{self.log()}")

    def channel(self) -> grpc.Channel:
        """A channel to the process, with the TLS settings its environment (DISAGG_TLS_*) gives it."""
        settings = tls_from_args(argparse.Namespace(), self.env)
        if settings.dials_tls:
            return grpc.secure_channel(self.address, settings.channel_credentials())
        return grpc.insecure_channel(self.address)

    @property
    def metrics_address(self) -> str | None:
        """host:port of the process's Prometheus endpoint, from its log."""
        return self._log_match(METRICS_LINE, "address")

    @property
    def http_url(self) -> str | None:
        """http://host:port of a router's OpenAI-compatible front door, from its log (None: HTTP off)."""
        return self._log_match(HTTP_LINE, "url")

    def _log_match(self, line_pattern: re.Pattern, group: str) -> str | None:
        """`group` of the first log line `line_pattern` matches (its last segment), or None."""
        for line in self._lines:
            match = line_pattern.match(last_segment(line))
            if match:
                return match[group]
        return None

    def log(self) -> str:
        return "".join(self._lines)

    def signal(self, sig: signal.Signals) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit code (negative: killed by a signal)."""
        self.signal(signal.SIGTERM)
        return self.wait_stopped(timeout_s)

    def wait_stopped(self, timeout_s: float = 15.0) -> int:
        """The exit code once it exits (told to stop already), SIGKILL after `timeout_s`."""
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self._reader.join(timeout=5)
        return self.popen.returncode

    def _read_output(self) -> None:
        for line in self.popen.stdout:
            self._lines.append(line)
            match = SERVING_LINE.match(last_segment(line))
            if match and self.address is None:
                self.address = match["address"]
                self._announced.set()
        self.popen.stdout.close()
        self._announced.set()


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now (for flags where 0 does not mean "pick one", e.g. --http-port).

    Taken from below the kernel's ephemeral range: a port from inside it (what binding port 0 gives) can be given
    to any outgoing connection (a gRPC client's, say) before the server binds it, and the server then fails with
    "address already in use". Below the range only an explicit bind can take it; none is handed out twice.
    """
    low = _ephemeral_low()
    candidates = [p for p in range(max(1024, low - 12000), low) if p not in _HANDED_OUT]
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:  # nothing free below the range: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def start_service(role: str, *args: str, env: Mapping[str, str] | None = None,
                  timeout_s: float = DEFAULT_START_TIMEOUT_S) -> ServiceProcess:
    """Start `python -m services.<role>` on a free port and wait until it serves."""
    return start_services([(role, args)], env=env, timeout_s=timeout_s)[0]


def start_services(specs: list[tuple[str, tuple[str, ...]]], env: Mapping[str, str] | None = None,
                   timeout_s: float = DEFAULT_START_TIMEOUT_S) -> list[ServiceProcess]:
    """Start several at once (they load in parallel); if any fails, all are stopped."""
    processes: list[ServiceProcess] = []
    try:
        for role, args in specs:
            processes.append(ServiceProcess.spawn(role, *args, env=env))
        for process in processes:
            process.wait_ready(timeout_s)
    except BaseException:
        for process in processes:
            process.stop()
        raise
    return processes


def start_prefill_decode(model: str, worker_args: tuple[str, ...] = (), env: Mapping[str, str] | None = None,
                         router_args: tuple[str, ...] = ("--max-local-prefill-tokens", "0")) -> list[ServiceProcess]:
    """A prefill worker and a decode worker (both with `worker_args`), then a router over them (every prompt
    prefilled remotely unless `router_args` say otherwise): [router, prefill, decode]; all stopped if one fails."""
    workers = start_services([("prefill", ("--model", model, *worker_args)),
                              ("decode", ("--model", model, *worker_args))], env=env)
    try:
        router = start_services([("router", ("--model", model, "--prefill-workers", workers[0].address,
                                             "--decode-workers", workers[1].address, *router_args))], env=env)[0]
    except BaseException:
        stop_in_waves(workers)
        raise
    return [router, *workers]


@contextmanager
def prefill_decode(model: str, worker_args: tuple[str, ...] = (), env: Mapping[str, str] | None = None,
                   router_args: tuple[str, ...] = ("--max-local-prefill-tokens", "0")) -> Iterator[list[ServiceProcess]]:
    """start_prefill_decode's [router, prefill, decode] for a `with` block, stopped in waves when it ends."""
    processes = start_prefill_decode(model, worker_args, env, router_args)
    try:
        yield processes
    finally:
        stop_in_waves(processes)


def stop_in_waves(processes: list[ServiceProcess]) -> list[int]:
    """Exit codes in the order given. The routers first (they may still be draining requests to the workers), then
    all the others, as `disagg up` stops its children: each wave is sent SIGTERM at once, then waited for, so N
    processes stop in about the time of one (about a second each), not one after the other."""
    codes: dict[ServiceProcess, int] = {}
    for wave in ([p for p in processes if p.role == "router"], [p for p in processes if p.role != "router"]):
        for process in wave:
            process.signal(signal.SIGTERM)
        codes |= {process: process.wait_stopped() for process in wave}
    return [codes[process] for process in processes]


def stop_cleanly(processes: list[ServiceProcess]) -> None:
    """Stop every process (all of them, before any assertion: stop_in_waves), then assert each exited 0 without a
    traceback."""
    for process, code in zip(processes, stop_in_waves(processes)):
        assert code == 0, f"{process.name} exited with {code}:\n{process.log()}"
        assert "Traceback" not in process.log(), process.log()

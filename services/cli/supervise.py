"""Child service processes of `disagg up`: started, echoed, health-checked, restarted with back-off, stopped.

A child announces `disagg-<role> serving on HOST:PORT` when it is up, and `disagg-<role> metrics on
http://HOST:PORT/metrics`. A child that dies is started again on the same gRPC and metrics ports (so the
router's worker list and a Prometheus scrape list stay right), after a back-off that doubles with each
restart in a row (1 s, 2 s, 4 s, ... up to 30 s) and resets once it has run for a minute.
"""
from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import channels
from services.kit.drain import DEFAULT_DRAIN_TIMEOUT_S

_READY_LINE = re.compile(r"disagg-(\w+) serving on (\S+)(?: \((.*)\))?")
_METRICS_LINE = re.compile(r"disagg-[\w-]+ metrics on (http://\S+/metrics)")
STOP_MARGIN_S = 10.0  # SIGTERM drains a child (up to its --drain-timeout); this long more, then SIGKILL
_STOP_GRACE_S = DEFAULT_DRAIN_TIMEOUT_S + STOP_MARGIN_S
_FIRST_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 30.0
_STABLE_S = 60.0  # a child that ran this long starts its back-off afresh


def log(message: str) -> None:
    sys.stderr.write(f"disagg up: {message}\n")
    sys.stderr.flush()


def how_it_ended(returncode: int) -> str:
    """`exited with code 3`, or `was killed by SIGKILL` (Popen gives -N for a signal N)."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


@dataclass(eq=False)
class Child:
    """One service process; a thread echoes its output and notes the address it announces."""

    name: str
    module: str
    args: list[str]
    echo: bool = True
    env: dict[str, str] = field(default_factory=dict)  # set in the child's environment, beside ours
    cores: tuple[int, ...] | None = None  # the child's CPU affinity (its threads inherit it); None: ours
    health_metadata: tuple[tuple[str, str], ...] = ()  # sent with its health checks (an API key, where it asks one)
    process: subprocess.Popen | None = None
    address: str | None = None
    note: str = ""  # what its ready line says beside the address (how long it took; a worker's KV capacity)
    metrics_url: str | None = None  # as announced; its port is kept across restarts
    ready: threading.Event = field(default_factory=threading.Event)
    metrics_ready: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))
    restarts: int = 0
    started_at: float = 0.0
    restart_at: float | None = None  # monotonic time of the pending restart, if the child is dead
    retiring: bool = False  # stopped for good (a planner's role move): not restarted when it exits

    @classmethod
    def start(cls, name: str, module: str, args: list[str], echo: bool = True, env: dict[str, str] | None = None,
              cores: tuple[int, ...] | None = None, health_metadata: tuple[tuple[str, str], ...] = ()) -> "Child":
        child = cls(name, module, list(args), echo, dict(env or {}), cores, health_metadata)
        child._spawn()
        return child

    def _spawn(self) -> None:
        self.ready, self.metrics_ready = threading.Event(), threading.Event()
        self.started_at = time.monotonic()
        self.process = subprocess.Popen([sys.executable, "-u", "-m", self.module, *self.args], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                        env={**os.environ, **self.env} if self.env else None)
        if self.cores is not None:  # before the child has started a thread: Python is still starting up
            with contextlib.suppress(ProcessLookupError):  # it died at once: supervise() reports it
                os.sched_setaffinity(self.process.pid, self.cores)
        self.reader = threading.Thread(target=self._pump, args=(self.process, self.ready, self.metrics_ready),
                                       name=f"{self.name}-output", daemon=True)
        self.reader.start()

    def _pump(self, process: subprocess.Popen, ready: threading.Event, metrics_ready: threading.Event) -> None:
        for line in process.stdout:
            self.tail.append(line)
            if not self._note(line, ready, metrics_ready) and self.echo:
                sys.stderr.write(f"[{self.name}] {line}")

    def _note(self, line: str, ready: threading.Event, metrics_ready: threading.Event) -> bool:
        """Take the addresses a child announces; True for such a line (it is not echoed)."""
        match = _READY_LINE.search(line)
        if match and not ready.is_set():
            self.address, self.note = match.group(2), match.group(3) or ""
            ready.set()
            if self.restarts:
                log(f"{self.name} is back on {self.address} (restart {self.restarts})")
            return True
        match = _METRICS_LINE.search(line)
        if match and not metrics_ready.is_set():
            self.metrics_url = match.group(1)
            metrics_ready.set()
            return True
        return False

    @property
    def serves_metrics(self) -> bool:
        """Whether the child was asked for a metrics endpoint (`--metrics-port -1` turns it off)."""
        return _flag_value(self.args, "--metrics-port") not in (None, "-1")

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def last_line(self) -> str | None:
        """The last line the child wrote (once it has exited, after its output is read to the end)."""
        if self.reader is not None and not self.alive:
            self.reader.join(timeout=2)
        lines = [line.strip() for line in self.tail if line.strip()]
        return lines[-1] if lines else None

    def ended(self) -> str:
        """One line for a child that has exited: how it ended, then its last output, labelled as such."""
        last = self.last_line()
        return (f"{self.name} {how_it_ended(self.process.returncode)}; "
                f"{f'its last output: {last}' if last else 'it wrote nothing'}")

    def supervise(self, now: float) -> None:
        """Called periodically: notices a death and schedules a restart; performs it when its time comes."""
        if self.retiring:
            return
        if self.restart_at is None:
            if self.alive:
                return
            if now - self.started_at >= _STABLE_S:
                self.restarts = 0
            delay = min(_FIRST_BACKOFF_S * 2 ** self.restarts, _MAX_BACKOFF_S)
            self.restart_at = now + delay
            log(f"{self.name} {how_it_ended(self.process.returncode)}; restarting it in {delay:.0f}s")
            last = self.last_line()
            if last:
                log(f"{self.name}'s last output: {last}")
        elif now >= self.restart_at:
            self.restart_at = None
            self.restarts += 1
            if self.address:  # the same port: the router (or the workers' clients) keep their address
                self.args = with_flag(self.args, "--port", self.address.rsplit(":", 1)[1])
            if self.metrics_url:  # and Prometheus its scrape target
                self.args = with_flag(self.args, "--metrics-port", str(urllib.parse.urlsplit(self.metrics_url).port))
            self._spawn()

    def stop(self) -> None:
        self.restart_at = None
        if self.alive:
            self.process.send_signal(signal.SIGTERM)


def _flag_value(args: list[str], flag: str) -> str | None:
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    return values[-1] if values else None


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """`args` with `flag` given once, as `value` (every earlier value of it dropped)."""
    kept = [a for i, a in enumerate(args) if a != flag and (i == 0 or args[i - 1] != flag)]
    return [*kept, flag, value]


def wait_ready(children: list[Child], timeout_s: float) -> None:
    """Until every child announced its addresses and answers health SERVING; RuntimeError (one line) if one
    dies or does not get there in time."""
    deadline = time.monotonic() + timeout_s
    for child in children:
        _wait_announced(child, child.ready, deadline, timeout_s)
        _check_health(child, deadline)
        if child.serves_metrics:
            _wait_announced(child, child.metrics_ready, deadline, timeout_s)


def _wait_announced(child: Child, announced: threading.Event, deadline: float, timeout_s: float) -> None:
    while not announced.wait(0.1):
        if not child.alive:
            raise RuntimeError(child.ended())
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} did not start within {timeout_s:.0f}s; its last output: "
                               f"{child.last_line() or 'none'}")


def _check_health(child: Child, deadline: float) -> None:
    """Until the child answers SERVING; a child that dies meanwhile is reported as such, not as an RPC error."""
    with channels.sync_channel(child.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5, metadata=child.health_metadata).status
                problem = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as exc:
                status, problem = None, f"{exc.code().name}: {exc.details()}"
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            if not child.alive:
                raise RuntimeError(child.ended())
            if time.monotonic() > deadline:
                raise RuntimeError(f"{child.name} at {child.address} is not SERVING ({problem})")
            time.sleep(0.1)


def stop_all(children: list[Child], grace_s: float = _STOP_GRACE_S) -> None:
    """The router first, then the workers: a request the router is still draining reaches a decode worker that
    is not draining yet. Each wave gets `grace_s` (its drain timeout and a margin) before SIGKILL."""
    routers = [c for c in children if c.name == "router" or c.name.startswith("router-")]
    for wave in (routers, [c for c in children if c not in routers]):
        _stop_together(wave, grace_s)


def _stop_together(children: list[Child], grace_s: float) -> None:
    for child in children:
        child.stop()
    deadline = time.monotonic() + grace_s
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()

"""Child service processes of `disagg up`: started, echoed, health-checked, restarted with back-off, stopped.

A child announces `disagg-<role> serving on HOST:PORT` when it is up. A child that dies is started
again on the same port (so the router's worker list stays right), after a back-off that doubles with
each restart in a row (1 s, 2 s, 4 s, ... up to 30 s) and resets once it has run for a minute.
"""
from __future__ import annotations

import collections
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import channels

_READY_LINE = re.compile(r"disagg-(\w+) serving on (\S+)")
_STOP_GRACE_S = 15.0
_FIRST_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 30.0
_STABLE_S = 60.0  # a child that ran this long starts its back-off afresh


def log(message: str) -> None:
    sys.stderr.write(f"disagg up: {message}\n")
    sys.stderr.flush()


@dataclass(eq=False)
class Child:
    """One service process; a thread echoes its output and notes the address it announces."""

    name: str
    module: str
    args: list[str]
    echo: bool = True
    process: subprocess.Popen | None = None
    address: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))
    restarts: int = 0
    started_at: float = 0.0
    restart_at: float | None = None  # monotonic time of the pending restart, if the child is dead

    @classmethod
    def start(cls, name: str, module: str, args: list[str], echo: bool = True) -> "Child":
        child = cls(name, module, list(args), echo)
        child._spawn()
        return child

    def _spawn(self) -> None:
        self.ready = threading.Event()
        self.started_at = time.monotonic()
        self.process = subprocess.Popen([sys.executable, "-u", "-m", self.module, *self.args], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=self._pump, args=(self.process, self.ready), name=f"{self.name}-output",
                         daemon=True).start()

    def _pump(self, process: subprocess.Popen, ready: threading.Event) -> None:
        for line in process.stdout:
            self.tail.append(line)
            match = _READY_LINE.search(line)
            if match and not ready.is_set():
                self.address = match.group(2)
                ready.set()
                if self.restarts:
                    log(f"{self.name} is back on {self.address} (restart {self.restarts})")
            elif self.echo:
                sys.stderr.write(f"[{self.name}] {line}")

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def last_line(self) -> str:
        lines = [line.strip() for line in self.tail if line.strip()]
        return lines[-1] if lines else "(no output)"

    def supervise(self, now: float) -> None:
        """Called periodically: notices a death and schedules a restart; performs it when its time comes."""
        if self.restart_at is None:
            if self.alive:
                return
            if now - self.started_at >= _STABLE_S:
                self.restarts = 0
            delay = min(_FIRST_BACKOFF_S * 2 ** self.restarts, _MAX_BACKOFF_S)
            self.restart_at = now + delay
            log(f"{self.name} exited with code {self.process.returncode} ({self.last_line()}); "
                f"restarting it in {delay:.0f}s")
        elif now >= self.restart_at:
            self.restart_at = None
            self.restarts += 1
            if self.address:  # the same port: the router (or the workers' clients) keep their address
                self.args = _with_port(self.args, self.address.rsplit(":", 1)[1])
            self._spawn()

    def stop(self) -> None:
        self.restart_at = None
        if self.alive:
            self.process.send_signal(signal.SIGTERM)


def _with_port(args: list[str], port: str) -> list[str]:
    kept = [a for i, a in enumerate(args) if a != "--port" and (i == 0 or args[i - 1] != "--port")]
    return [*kept, "--port", port]


def wait_ready(children: list[Child], timeout_s: float) -> None:
    """Until every child announced its address and answers health SERVING; RuntimeError (one line) if one dies."""
    deadline = time.monotonic() + timeout_s
    for child in children:
        while not child.ready.wait(0.1):
            if not child.alive:
                raise RuntimeError(f"{child.name} exited with code {child.process.returncode}: {child.last_line()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{child.name} did not start within {timeout_s:.0f}s: {child.last_line()}")
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
        if child.process is None:
            continue
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()

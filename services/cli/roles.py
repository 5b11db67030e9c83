"""`disagg up --planner`: workers moved between roles at run time, and the thread that decides when.

Our roles are separate processes, so a worker moves by being replaced: the old process drains (SIGTERM: NOT_SERVING
at once, so the router picks it no more; its requests in flight finish and its exported KV is pulled, up to
--drain-timeout), exits, and a process of the other role starts on the same slot (its GPUs, or its CPU cores, and
its metrics port). The new process loads the weights again (from the page cache, warm after the first load); a
role change without a reload would need one process serving both roles, which our workers do not.

The router learns of the change without a restart: every slot has a gRPC port for each role, fixed at start, and
the router is given every slot's prefill port as --prefill-workers and every decode port as --decode-workers. At
any time a slot serves on one of its two ports; the router uses the workers that answer and SERVING, and keeps
probing the silent ports (GetInfo, every few seconds), so the new process is picked up once it serves.
"""
from __future__ import annotations

import argparse
import dataclasses
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

from services.cli.placement import WorkerPlacement
from services.cli.supervise import STOP_MARGIN_S, Child, log, wait_ready, with_flag
from services.planner.rebalance import WAITING, Rebalancer, scrape, window
from services.planner.workload import parse_slo

ROLES = ("prefill", "decode")
# The router waits this long for a listed worker before it serves without it: the live workers answer at once (up
# starts the router once they serve), the other role's ports of every slot never do until a move.
PLANNER_WORKER_WAIT_S = 2.0


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Slot:
    """Where one worker runs, whichever its role: its GPUs (or cores) and a gRPC port for each role."""

    placement: WorkerPlacement
    ports: dict[str, int]
    child: Child | None = None

    @property
    def role(self) -> str:
        return self.child.name.rsplit("-", 1)[0]


def reserve_slots(workers: tuple[WorkerPlacement, ...], host: str) -> list[Slot]:
    return [Slot(w, {role: free_port(host) for role in ROLES}) for w in workers]


def slot_addresses(slots: list[Slot], host: str) -> dict[str, str]:
    """The router's --prefill-workers and --decode-workers: every slot's port of that role."""
    return {role: ",".join(f"{host}:{s.ports[role]}" for s in slots) for role in ROLES}


class RoleMoves:
    """Moves a worker of one role to the other: drains the old process, then starts the new one on its slot.
    `start(slot, role, name)` starts a worker process; `children` is up's list (the main loop supervises it)."""

    def __init__(self, children: list[Child], slots: list[Slot], start: Callable[[Slot, str, str], Child],
                 start_timeout_s: float, drain_timeout_s: float, log: Callable[[str], None]):
        self.children, self.slots, self.start = children, slots, start
        self.start_timeout_s, self.drain_timeout_s, self.log = start_timeout_s, drain_timeout_s, log

    def counts(self) -> dict[str, int]:
        return {role: sum(s.role == role for s in self.slots) for role in ROLES}

    def move(self, source: str, target: str, why: str) -> Child:
        slot = [s for s in self.slots if s.role == source][-1]
        old, started = slot.child, time.monotonic()
        self.log(f"planner: moving {old.name} to {target} ({why}): draining it first")
        old.retiring = True
        old.stop()
        try:
            old.process.wait(timeout=self.drain_timeout_s + STOP_MARGIN_S)
        except subprocess.TimeoutExpired:
            old.process.kill()
            old.process.wait()
        self.children.remove(old)
        drained = time.monotonic() - started
        taken = {c.name for c in self.children}
        name = next(f"{target}-{i}" for i in range(len(self.slots) + 1) if f"{target}-{i}" not in taken)
        new = slot.child = self.start(slot, target, name)
        self.children.append(new)
        wait_ready([new], self.start_timeout_s)
        self.log(f"planner: {name} serving on {new.address} in place of {old.name} (drained in {drained:.1f}s, "
                 f"started in {time.monotonic() - started - drained:.1f}s: a new process, the weights loaded again); "
                 f"now {self.counts()['prefill']} prefill, {self.counts()['decode']} decode")
        return new


class PlannerThread(threading.Thread):
    """Every `interval_s`: scrape the routers and the workers, let the rebalancer judge the window, make its move."""

    def __init__(self, rebalancer: Rebalancer, moves: RoleMoves, routers: Callable[[], list[Child]],
                 interval_s: float, log: Callable[[str], None]):
        super().__init__(name="planner", daemon=True)
        self.rebalancer, self.moves, self.routers = rebalancer, moves, routers
        self.interval_s, self.log = interval_s, log
        self.stopped = threading.Event()

    def _router_samples(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for router in self.routers():
            if router.metrics_url:
                for key, value in scrape(router.metrics_url).items():
                    total[key] = total.get(key, 0.0) + value
        return total

    def _waiting(self) -> dict[str, float]:
        out = {role: 0.0 for role in ROLES}
        for slot in self.moves.slots:
            if slot.child is not None and slot.child.metrics_url and slot.child.alive:
                try:
                    out[slot.role] += scrape(slot.child.metrics_url).get(WAITING, 0.0)
                except OSError:
                    pass  # a worker starting or stopping: its queue counts as empty
        return out

    def run(self) -> None:
        before, at = None, time.monotonic()
        while not self.stopped.wait(self.interval_s if before is not None else 0):
            try:
                after, now = self._router_samples(), time.monotonic()
            except OSError as exc:
                self.log(f"planner: the router's metrics did not answer ({exc}); trying again")
                continue
            if before is not None:
                w = window(before, after, now - at, self.rebalancer.slo, self._waiting())
                move, line = self.rebalancer.observe(w, self.moves.counts(), now)
                self.log(line)
                if move is not None and not self.stopped.is_set():
                    try:
                        self.moves.move(move.source, move.target, move.why)
                    except RuntimeError as exc:
                        self.log(f"planner: the move failed: {exc}")
                    after, now = self._router_samples(), time.monotonic()
            before, at = after, now


def start_planner(args: argparse.Namespace, slots: list[Slot], router_names: list[str], children: list[Child],
                  worker_argv: Callable[[WorkerPlacement, int], list[str]]) -> PlannerThread:
    """--planner: the thread that moves workers between roles by the routers' metrics. `worker_argv(placement,
    metrics_port)`: up's command line for a worker (the port is set here, the slot's for the role)."""
    def start(slot: Slot, role: str, name: str) -> Child:
        previous = slot.child
        placement = dataclasses.replace(slot.placement, name=name, role=role)
        metrics = int(previous.metrics_url.rsplit(":", 1)[1].split("/")[0]) if previous.metrics_url else 0
        argv = with_flag(worker_argv(placement, metrics), "--port", str(slot.ports[role]))
        return Child.start(name, f"services.{role}", argv, env=previous.env, cores=previous.cores)

    moves = RoleMoves(children, slots, start, args.start_timeout, args.drain_timeout, log)
    minimum = {"prefill": args.planner_min_prefill, "decode": args.planner_min_decode}
    rebalancer = Rebalancer(parse_slo(args.slo), minimum, args.planner_windows, args.planner_cooldown,
                            args.planner_ratio)
    thread = PlannerThread(rebalancer, moves, lambda: [c for c in children if c.name in router_names],
                           args.planner_interval, log)
    log(f"planner: every {args.planner_interval:g}s against {args.slo}; a move after {args.planner_windows} windows "
        f"in a row, {args.planner_cooldown:g}s apart, keeping {minimum['prefill']} prefill and {minimum['decode']} "
        "decode at least (docs/planner.md)")
    thread.start()
    return thread

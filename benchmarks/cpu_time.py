"""CPU time of processes as Linux counts it (/proc/PID/stat: utime + stime, in clock ticks), for the benches and the
tests that check a process costs nothing while it waits."""
from __future__ import annotations

import os
import time
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> int:
    """utime + stime of every thread of `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted after the name


def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant alive now."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # it ended meanwhile
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def cores_used(pids: list[int], window_s: float) -> dict[int, float]:
    """Each process's CPU time over the next `window_s`, as a fraction of one core."""
    before = {pid: cpu_ticks(pid) for pid in pids}
    start = time.monotonic()
    time.sleep(window_s)
    after = {pid: cpu_ticks(pid) for pid in pids}
    elapsed = time.monotonic() - start
    return {pid: (after[pid] - before[pid]) / TICKS_PER_S / elapsed for pid in pids}

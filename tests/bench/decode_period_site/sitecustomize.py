"""Loaded by tests/bench/decode_period.py through PYTHONPATH in every process `disagg up` starts: in the decode worker
alone it wraps LLMEngine.step to record each step's wall clock, the engine thread's CPU time and its wait for a core
(/proc schedstat), the running batch after it, and whether a step launched ahead (async scheduling) was waiting for it,
and writes them to $DISAGG_STEP_TIMES_DIR/steps-<pid>.json every 256 steps and at exit. Also loaded by
tests/bench/multi_gpu.py --step-times."""
import atexit
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

_OUT = os.environ.get("DISAGG_STEP_TIMES_DIR")


def _run_delay_ns(tid: int) -> int:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[1])
    except OSError:
        return 0


def _wrap(module) -> None:
    records: list[tuple[float, float, float, float, int, int]] = []
    path = os.path.join(_OUT, f"steps-{os.getpid()}.json")

    def dump() -> None:
        with open(path, "w") as f:
            json.dump(records, f)

    step = module.LLMEngine.step

    def timed_step(self):
        tid = threading.get_native_id()
        wall, cpu, delay = time.perf_counter(), time.thread_time(), _run_delay_ns(tid)
        ahead = int(getattr(self, "_ahead", None) is not None)
        try:
            return step(self)
        finally:
            records.append((wall, time.perf_counter(), time.thread_time() - cpu, (_run_delay_ns(tid) - delay) / 1e9,
                            len(self.scheduler.running), ahead))
            if len(records) % 256 == 0:
                dump()

    module.LLMEngine.step = timed_step
    atexit.register(dump)


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "common.engine.engine":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _wrap(module)

        spec.loader.exec_module = exec_and_wrap
        return spec


with open("/proc/self/cmdline", "rb") as _f:
    if _OUT and b"services.decode" in _f.read():
        sys.meta_path.insert(0, _AfterImport())

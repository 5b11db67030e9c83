"""Loaded by benchmarks/decode_period.py through PYTHONPATH in every process `disagg up` starts: in the decode worker
alone it wraps LLMEngine.step to record each step's wall clock, the engine thread's CPU time and its wait for a core
(/proc schedstat), the running batch after it, whether a step launched ahead (async scheduling) was waiting for it,
and the prompt tokens the engine had to compute when it began (a step with some is a mixed step: a chunk beside the
decode rows). It appends them to $DISAGG_STEP_TIMES_DIR/steps-<pid>.jsonl (a record a line) every 256 steps and at
exit, from a thread of its own: only the new ones (rewriting every record so far on the engine thread cost it tens
of ms a write late in a run, long gaps that the ITL tail then showed; appending 256 costs ~1.4 ms on the 2-core
machine). Also loaded by benchmarks/multi_gpu.py --step-times; `read_steps` reads a folder of them."""
import atexit
import importlib.abc
import importlib.util
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path

_OUT = os.environ.get("DISAGG_STEP_TIMES_DIR")


def _run_delay_ns(tid: int) -> int:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[1])
    except OSError:
        return 0


def _wrap(module) -> None:
    records: list[tuple[float, float, float, float, int, int, int]] = []
    path = os.path.join(_OUT, f"steps-{os.getpid()}.jsonl")
    batches: queue.SimpleQueue = queue.SimpleQueue()

    def write() -> None:  # a thread of its own: mostly while the engine thread waits for the GPU (GIL released)
        while (batch := batches.get()) is not None:
            with open(path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in batch)

    writer = threading.Thread(target=write, name="step-times-writer", daemon=True)
    writer.start()

    def dump() -> None:
        batches.put(records[:])
        records.clear()

    def flush_at_exit() -> None:
        dump()
        batches.put(None)
        writer.join(timeout=10)

    step = module.LLMEngine.step

    def timed_step(self):
        tid = threading.get_native_id()
        wall, cpu, delay = time.perf_counter(), time.thread_time(), _run_delay_ns(tid)
        ahead = int(getattr(self, "_ahead", None) is not None)
        prompts = self.prompt_tokens_to_compute()
        try:
            return step(self)
        finally:
            records.append((wall, time.perf_counter(), time.thread_time() - cpu, (_run_delay_ns(tid) - delay) / 1e9,
                            len(self.scheduler.running), ahead, prompts))
            if len(records) == 256:
                dump()

    module.LLMEngine.step = timed_step
    atexit.register(flush_at_exit)


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


def read_steps(folder) -> list[list[list[float]]]:
    """Every decode worker's records in `folder`, one list per worker, in step order."""
    return [[json.loads(line) for line in f.read_text().splitlines()]
            for f in sorted(Path(folder).glob("steps-*.jsonl"))]


with open("/proc/self/cmdline", "rb") as _f:
    if _OUT and b"services.decode" in _f.read():
        sys.meta_path.insert(0, _AfterImport())

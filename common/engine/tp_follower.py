"""`python -m common.engine.tp_follower CONFIG RANK SIZE PORT`: one follower rank of a tensor-parallel engine.

Started by rank 0 (common/engine/tp_ranks.py), never by hand. It joins the group, loads its share of the model
with its KV cache (on the CPU the one rank 0 describes down stdin; on a GPU its own, shared with rank 0), and
then runs each step that arrives on stdin until stdin ends. Signals meant for the worker (Ctrl-C in `disagg
up`, SIGTERM on a drain) are rank 0's to act on; this process leaves when its stdin closes, and a watch on its
parent ends it when rank 0 is gone while it waits in a collective.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from common.engine.config import EngineConfig
from common.engine.model_runner import ModelRunner
from common.engine.parallel import TensorParallel, rank_device
from common.engine.shared_cache import SharedKvCache
from common.engine.tp_ranks import read_message
from common.heap import settle_heap

_PARENT_POLL_S = 0.5


def _die_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    _die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    settings, rank, size, port = json.loads(argv[0]), int(argv[1]), int(argv[2]), int(argv[3])
    config = EngineConfig(**settings)
    store = dist.TCPStore("127.0.0.1", port, size, False)
    device = rank_device(config.device, rank)
    tp = TensorParallel.join(store, rank, size, device)
    stdin = sys.stdin.buffer
    if device.type == "cuda":
        runner = ModelRunner(config, tp=tp)  # a cache of its own on its GPU, shared with rank 0
    else:
        cache: SharedKvCache = read_message(stdin)
        if cache is None:
            return 0
        runner = ModelRunner(config, tp=tp, kv_cache=cache.open())
        tp.all_reduce(torch.zeros(1))  # mapped and loaded: rank 0 may drop the file
    settle_heap()  # a collection here would hold up every rank's step, in the collectives
    waited = busy = 0.0
    steps = 0
    while True:
        start = time.perf_counter()
        step = read_message(stdin)
        launched = time.perf_counter()
        if step is None:
            break
        runner.follow(step)
        waited, busy, steps = waited + launched - start, busy + time.perf_counter() - launched, steps + 1
    tp.leave()  # with rank 0, which closes our stdin as it leaves too
    if steps:  # where a follower's host time goes: a follower slower than the GPU steps holds every rank back
        print(f"tensor-parallel rank {rank}: {steps} steps, {busy / steps * 1e6:.0f} us of host work and "
              f"{waited / steps * 1e6:.0f} us waiting for rank 0 a step", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    code = main(sys.argv[1:])
    # Leave at once: the NCCL communicator's and the CUDA IPC shares' destructors may wait on ranks already gone.
    os._exit(code)

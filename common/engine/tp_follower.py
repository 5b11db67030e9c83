"""`python -m common.engine.tp_follower CONFIG RANK SIZE PORT`: one follower rank of a tensor-parallel engine.

Started by rank 0 (common/engine/tp_ranks.py), never by hand. It joins the group, waits for the KV cache's
description, loads its share of the model on it, and then runs each step that arrives on stdin until stdin
ends. Signals meant for the worker (Ctrl-C in `disagg up`, SIGTERM on a drain) are rank 0's to act on; this
process leaves when its stdin closes, and a watch on its parent ends it when rank 0 is gone while it waits in
a collective.
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
from common.engine.parallel import TensorParallel
from common.engine.shared_cache import SharedKvCache
from common.engine.tp_ranks import read_message

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
    tp = TensorParallel.join(store, rank, size)
    stdin = sys.stdin.buffer
    cache: SharedKvCache = read_message(stdin)
    if cache is None:
        return 0
    runner = ModelRunner(config, tp=tp, kv_cache=cache.open())
    tp.all_reduce(torch.zeros(1))  # mapped and loaded: rank 0 may drop the file
    while (step := read_message(stdin)) is not None:
        runner.run_step(step)
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main(sys.argv[1:]))

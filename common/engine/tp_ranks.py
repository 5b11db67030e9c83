"""The other ranks of a tensor-parallel engine, seen from rank 0: started, fed every step, watched.

Rank 0 is the worker's own process: it schedules, owns the block manager and the KV sessions, and serves
gRPC. Ranks 1..N-1 are `python -m common.engine.tp_follower` processes. Each joins the group at rank 0's
store (gloo on the CPU, NCCL on GPUs), loads its share of the model, maps the KV cache rank 0 created (CPU) or
shares its own with rank 0 (GPUs), and runs every step rank 0 writes down its stdin (a pickled frame); the
steps' collectives keep the ranks in lockstep. Their lifetimes hang on rank 0:
its exit closes their stdin (and the kernel kills them with it: PR_SET_PDEATHSIG), and a follower that exits
while rank 0 lives takes rank 0 down too, logged, so the supervisor restarts the whole worker instead of a
collective waiting forever for a dead peer.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

import torch.distributed as dist

from common.engine.config import EngineConfig
from common.engine.parallel import TensorParallel, rank_device

log = logging.getLogger(__name__)
_FRAME = struct.Struct("<Q")
_JOIN_TIMEOUT = datetime.timedelta(minutes=5)  # the followers import torch and load their weights first
_WATCH_INTERVAL_S = 0.2
EXIT_RANK_LOST = 70  # the worker's exit code when a follower rank died under it


def write_message(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_FRAME.pack(len(data)) + data)
    stream.flush()


def read_message(stream: IO[bytes]) -> Any:
    """The next frame; None at the end of the stream (rank 0 has gone) as for an explicit stop."""
    header = stream.read(_FRAME.size)
    if len(header) < _FRAME.size:
        return None
    (size,) = _FRAME.unpack(header)
    return pickle.loads(stream.read(size))


class FollowerRanks:
    """Ranks 1..size-1 of rank 0's engine. `tp` is rank 0's own place in the group."""

    def __init__(self, config: EngineConfig):
        size = config.tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=_JOIN_TIMEOUT, wait_for_workers=False)
        settings = json.dumps(dataclasses.asdict(config))
        self._closing = False
        self.procs = [subprocess.Popen([sys.executable, "-m", "common.engine.tp_follower", settings, str(rank),
                                        str(size), str(store.port)], stdin=subprocess.PIPE)
                      for rank in range(1, size)]
        threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()
        self.tp = TensorParallel.join(store, 0, size, rank_device(config.device, 0))
        self._store = store  # the followers' rendezvous: kept for the group's lifetime

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, message: Any) -> None:
        """The same message to every follower, which runs it in step with rank 0."""
        for proc in self.procs:
            write_message(proc.stdin, message)

    def close(self) -> None:
        """Stop the followers: their stdin closes, they leave their loop and the group (with rank 0) and exit."""
        self._closing = True
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        if all(proc.poll() is None for proc in self.procs):  # every rank leaves the NCCL group together
            self.tp.leave()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _watch(self) -> None:
        while not self._closing:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._closing:
                    self._lost(rank, code)
            time.sleep(_WATCH_INTERVAL_S)

    def _lost(self, rank: int, code: int) -> None:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        log.error("tensor-parallel rank %d (pid %d) %s; the worker stops with it (exit %d) so that its supervisor "
                  "restarts every rank", rank, self.procs[rank - 1].pid, how, EXIT_RANK_LOST)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        logging.shutdown()
        os._exit(EXIT_RANK_LOST)

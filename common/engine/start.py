"""Start the engine a config names, from config.ENGINES (the engines import the interface; this imports them)."""
from __future__ import annotations

import sys
from importlib import import_module
from typing import TYPE_CHECKING

from common.engine.config import ENGINES, EngineConfig

if TYPE_CHECKING:
    from common.engine.interface import Engine


def check_startable(config: EngineConfig) -> None:
    """What would stop `start_engine` before it loads a weight, as InvalidConfig: a tensor-parallel size that does
    not divide the model's heads, or more ranks than GPUs (the engine's own checks; the config validated itself when
    it was built)."""
    if config.engine == "torch" and config.tensor_parallel_size > 1:  # TensorRT-LLM checks its own sharding
        # imported here: one rank has nothing to check, and `disagg up` (which calls this) need not load torch
        from common.engine.models.loader import check_shardable
        from common.engine.parallel import check_devices

        check_shardable(config.model, config.tensor_parallel_size)
        check_devices(config.device, config.tensor_parallel_size)


def start_engine(config: EngineConfig) -> Engine:
    """Load the engine `config.engine` names (blocking: call it in a thread): our PyTorch engine, started on its
    own thread, or TensorRT-LLM (InvalidConfig where it is not installed)."""
    module, name = ENGINES[config.engine].split(":")
    return getattr(import_module(f"common.engine.{module}"), name).from_config(config)


def teardowns_finished(timeout_s: float) -> bool:
    """Whether the engines' teardowns left running in the background (a tensor-parallel engine's NCCL
    communicator, parallel.TensorParallel.leave) have finished, waiting `timeout_s` at most. A process must not
    finalise while one runs (parallel.teardowns_finished says why)."""
    if "common.engine.parallel" not in sys.modules:  # no tensor-parallel engine was built here
        return True
    from common.engine.parallel import teardowns_finished as finished

    return finished(timeout_s)

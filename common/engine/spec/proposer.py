"""What every draft proposer offers the engine, and the one place that builds one from a config."""
from __future__ import annotations

from collections.abc import Sequence
from importlib import import_module
from typing import Protocol

import numpy as np

from common.engine.spec.config import PROPOSERS, SpeculativeConfig, require_supported


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int) -> list[int]:
        """Up to k draft tokens to follow a request's prompt + output `token_ids`; [] for none this step."""


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of config.method (config.PROPOSERS), imported on first use; InvalidConfig for a method that
    parses but is not built."""
    require_supported(config)
    module, name = PROPOSERS[config.method].split(":")
    return getattr(import_module(f"common.engine.spec.{module}"), name).from_config(config)

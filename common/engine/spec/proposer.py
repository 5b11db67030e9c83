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

    def close(self) -> None:
        """Free what it runs beside the target (a draft model's engine)."""


class BatchedProposer(Proposer, Protocol):
    """A proposer that drafts a step's rows together (a draft model: one batched loop, not one a row), which the
    Speculator then calls instead of `propose`."""

    def propose_many(self, histories: list[np.ndarray], ks: list[int]) -> list[list[int]]:
        """`propose` for every row at once: up to ks[i] drafts after histories[i]."""


def make_proposer(config: SpeculativeConfig, target=None) -> Proposer:
    """The proposer of config.method (config.PROPOSERS), imported on first use; InvalidConfig for a method that
    parses but is not built. `target`: the LLMEngine it drafts for (a draft model takes its device, dtype and
    KV shape from it; prompt lookup needs none)."""
    require_supported(config)
    module, name = PROPOSERS[config.method].split(":")
    return getattr(import_module(f"common.engine.spec.{module}"), name).from_config(config, target)

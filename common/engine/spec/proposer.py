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

    def forget(self, request_id: str) -> None:
        """Free what it keeps for a request that ended or was aborted (an EAGLE head's KV and hidden states)."""


class BatchedProposer(Proposer, Protocol):
    """A proposer that drafts a step's rows together (a draft model: one batched loop, not one a row), which the
    Speculator then calls instead of `propose`."""

    def propose_many(self, histories: list[np.ndarray], ks: list[int], request_ids: list[str]) -> list[list[int]]:
        """`propose` for every row at once: up to ks[i] drafts after histories[i], the prompt and output of the
        request request_ids[i] (an EAGLE head keeps each request's state by it)."""


def make_proposer(config: SpeculativeConfig, target=None) -> Proposer:
    """The proposer of config.method (config.PROPOSERS), imported on first use; InvalidConfig for a method that
    parses but is not built. `target`: the LLMEngine it drafts for (a draft model takes its device, dtype and
    KV shape from it, an EAGLE head its hidden states too; prompt lookup needs none)."""
    require_supported(config)
    module, name = PROPOSERS[config.method].split(":")
    return getattr(import_module(f"common.engine.spec.{module}"), name).from_config(config, target)

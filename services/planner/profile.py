"""A profile: what the engine measured of the model on one kind of device unit (a GPU, or TP GPUs; on the CPU a
worker's cores), and the step-cost model fitted to it. Cached per model, device and engine config.

The cost model is three small linear fits, each with non-negative coefficients (a coefficient a fit would make
negative is dropped and the rest refitted):

    prefill step  = a + b * tokens + c * sum(chunk * (tokens before it + chunk))   GEMMs linear, attention quadratic
    decode step   = a + b * rows + c * sum(context)                                weights once, KV read per token
    mixed step    = decode step + prefill step - prefill's a                       one launch for both (an estimate)
    handoff       = a + b * prompt tokens                                          export gather + import copy

Prefill is measured as whole prompts (b prompts of L tokens sent together), so its fit runs the features through
the same chunking the simulator and the engine use (`chunks`): a step's budget, a prompt's chunk limit.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from common.engine.default_model import cache_root

PROFILE_VERSION = 1  # bump when what is measured, or how, changes: older cached profiles are measured again


@dataclass(frozen=True)
class Limits:
    """The engine's scheduling limits the profile was measured under (and the simulator schedules by)."""

    step_tokens: int  # max_num_batched_tokens
    chunk_tokens: int  # a prompt's tokens a step at most (prefill_chunk_limit)
    max_num_seqs: int
    max_model_len: int


def chunks(remaining: Sequence[int], done: Sequence[int], budget: int, chunk_limit: int) -> list[tuple[int, int]]:
    """One step's prompt chunks, first come first served: (chunk tokens, tokens before it) for each prompt it
    advances, each at most `chunk_limit`, all together at most `budget`."""
    out = []
    for left, before in zip(remaining, done):
        if budget <= 0:
            break
        take = min(left, chunk_limit, budget)
        if take > 0:
            out.append((take, before))
            budget -= take
    return out


def prefill_features(steps: Sequence[Sequence[tuple[int, int]]]) -> np.ndarray:
    """(steps, tokens, attention term) summed over `steps`, each a list of (chunk, before)."""
    return np.array([len(steps), sum(c for s in steps for c, _ in s),
                     sum(c * (b + c) for s in steps for c, b in s)], dtype=float)


def prompt_steps(prompts: Sequence[int], limits: Limits) -> list[list[tuple[int, int]]]:
    """The steps an idle engine runs for `prompts` sent together."""
    remaining, done, steps = list(prompts), [0] * len(prompts), []
    while any(remaining):
        live = [i for i, r in enumerate(remaining) if r]
        step = chunks([remaining[i] for i in live], [done[i] for i in live], limits.step_tokens, limits.chunk_tokens)
        for i, (c, _) in zip(live, step):
            remaining[i] -= c
            done[i] += c
        steps.append(step)
    return steps


def fit_nonnegative(features: np.ndarray, seconds: np.ndarray) -> list[float]:
    """Least squares with every coefficient >= 0: the best of the fits over each subset of the features whose
    coefficients all come out non-negative (three features: eight fits)."""
    best, best_err = [0.0] * features.shape[1], float(np.sum(seconds ** 2))
    for size in range(1, features.shape[1] + 1):
        for subset in itertools.combinations(range(features.shape[1]), size):
            coef, *_ = np.linalg.lstsq(features[:, subset], seconds, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((features[:, subset] @ coef - seconds) ** 2))
            if err < best_err - 1e-18:
                best, best_err = [0.0] * features.shape[1], err
                for i, c in zip(subset, coef):
                    best[i] = float(c)
    return best


@dataclass(frozen=True)
class UnitProfile:
    """One device unit's measurements: prefill (b prompts of L tokens, seconds for all), decode steps (b rows at a
    mean context, seconds a step) and handoffs (prompt tokens, seconds)."""

    prefill: list[dict] = field(default_factory=list)  # {"batch", "prompt_len", "seconds"}
    decode: list[dict] = field(default_factory=list)  # {"batch", "context", "step_s"}
    handoff: list[dict] = field(default_factory=list)  # {"tokens", "seconds"}


class StepCosts:
    """The fitted cost model of one unit (see the module docstring)."""

    def __init__(self, unit: UnitProfile, limits: Limits):
        self.limits = limits
        rows = [prefill_features(prompt_steps([p["prompt_len"]] * p["batch"], limits)) for p in unit.prefill]
        self.prefill_coef = fit_nonnegative(np.array(rows), np.array([p["seconds"] for p in unit.prefill]))
        decode = np.array([[1.0, d["batch"], d["batch"] * d["context"]] for d in unit.decode])
        self.decode_coef = fit_nonnegative(decode, np.array([d["step_s"] for d in unit.decode]))
        if unit.handoff:
            handoff = np.array([[1.0, h["tokens"]] for h in unit.handoff])
            self.handoff_coef = fit_nonnegative(handoff, np.array([h["seconds"] for h in unit.handoff]))
        else:
            self.handoff_coef = [0.0, 0.0]

    def prefill_step(self, step: Sequence[tuple[int, int]]) -> float:
        a, b, c = self.prefill_coef
        return a + b * sum(n for n, _ in step) + c * sum(n * (before + n) for n, before in step)

    def decode_step(self, rows: int, context_sum: float) -> float:
        a, b, c = self.decode_coef
        return a + b * rows + c * context_sum

    def mixed_step(self, rows: int, context_sum: float, step: Sequence[tuple[int, int]]) -> float:
        if not step:
            return self.decode_step(rows, context_sum)
        if not rows:
            return self.prefill_step(step)
        return self.decode_step(rows, context_sum) + self.prefill_step(step) - self.prefill_coef[0]

    def handoff(self, tokens: int) -> float:
        return self.handoff_coef[0] + self.handoff_coef[1] * tokens

    def describe(self) -> str:
        pa, pb, pc = self.prefill_coef
        da, db, dc = self.decode_coef
        ha, hb = self.handoff_coef
        tok_s = f"{1 / pb:,.0f} tok/s" if pb else "unbounded"
        return (f"prefill {pa * 1e3:.2f} ms a step + {tok_s} + {pc * 1e9:.3f} ns per token pair; decode "
                f"{da * 1e3:.2f} ms a step + {db * 1e6:.1f} us a row + {dc * 1e9:.3f} ns per context token; handoff "
                f"{ha * 1e3:.2f} ms + {hb * 1e6:.2f} us a token")


@dataclass(frozen=True)
class Profile:
    key: str
    model: str
    device: str  # what the units are: "cuda: NVIDIA H200 x4" / "cpu: 2 cores (model name)"
    engine: dict  # the engine config it was measured with (its fields, as JSON)
    limits: Limits
    units: dict[str, UnitProfile]  # "gpus=1", "gpus=2" (a worker's TP size) / "cores=1", ...
    measured_at: float = field(default_factory=time.time)
    version: int = PROFILE_VERSION

    def costs(self, unit: str) -> StepCosts:
        return StepCosts(self.units[unit], self.limits)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        raw = json.loads(text)
        units = {name: UnitProfile(**unit) for name, unit in raw.pop("units").items()}
        return cls(limits=Limits(**raw.pop("limits")), units=units, **raw)


def profile_key(model_identity: dict, device: str, engine: dict, units: Sequence[str]) -> str:
    """The cache key: a hash of the model (its path and config, its weight files' sizes), the device, the engine
    config and the units measured, and the profiler's version."""
    blob = json.dumps({"model": model_identity, "device": device, "engine": engine, "units": sorted(units),
                       "version": PROFILE_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def model_identity(model_dir: str) -> dict:
    """What tells one model from another without reading its weights: its path, config.json and weight file sizes."""
    root = Path(model_dir)
    config = root / "config.json"
    weights = sorted((p.name, p.stat().st_size) for p in root.glob("*.safetensors")) if root.is_dir() else []
    return {"path": str(root.resolve()) if root.exists() else model_dir,
            "config": config.read_text() if config.is_file() else "", "weights": weights}


def cache_dir() -> Path:
    return cache_root() / "profiles"


def cached(key: str, directory: Path | None = None) -> Profile | None:
    """The cached profile of `key`, or None (missing, unreadable, or of another profiler version)."""
    path = (directory or cache_dir()) / f"{key}.json"
    try:
        profile = Profile.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return profile if profile.version == PROFILE_VERSION and profile.key == key else None


def store(profile: Profile, directory: Path | None = None) -> Path:
    path = (directory or cache_dir()) / f"{profile.key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(profile.to_json())
    tmp.replace(path)
    return path

"""Sampling flags of `disagg run` and `disagg generate`. Torch-free: the client imports it.

The defaults are the default model's recommended sampling, so the first answer a user sees reads
well: SmolLM2's model card recommends temperature 0.2 and top_p 0.9, and a repetition penalty of 1.1
keeps the 135M model from repeating one phrase until max_tokens (greedy does, on the quickstart's haiku).
Greedy decoding (what Hugging Face's `generate` does by default) is `--greedy` or `--temperature 0`.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

DEFAULT_TEMPERATURE = 0.2
DEFAULT_TOP_P = 0.9
DEFAULT_REPETITION_PENALTY = 1.1


@dataclass(frozen=True)
class CliSampling:
    temperature: float
    top_p: float
    repetition_penalty: float
    max_tokens: int
    seed: int | None


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling", f"default: temperature {DEFAULT_TEMPERATURE}, top_p {DEFAULT_TOP_P}, "
                                              f"repetition penalty {DEFAULT_REPETITION_PENALTY}")
    g.add_argument("--greedy", action="store_true",
                   help="greedy decoding, as HF generate: temperature 0, top_p 1, no repetition penalty")
    g.add_argument("--temperature", type=float, default=None, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None, help="1 is none")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--seed", type=int, default=None)


def sampling_from_args(args: argparse.Namespace) -> CliSampling:
    greedy = args.greedy or args.temperature == 0
    defaults = (0.0, 1.0, 1.0) if greedy else (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_REPETITION_PENALTY)
    chosen = (0.0 if args.greedy else args.temperature, args.top_p, args.repetition_penalty)
    temperature, top_p, penalty = (d if c is None else c for c, d in zip(chosen, defaults))
    return CliSampling(temperature, top_p, penalty, args.max_tokens, args.seed)

"""What sampling costs a decode step, next to the greedy step (no draw: the floor).

    python -m benchmarks.sampling_step                  # SmolLM2-135M-Instruct, bf16, one torch thread, batch 1 and 8
    python -m benchmarks.sampling_step --batch 32 --rounds 3
    python -m benchmarks.sampling_step --device cuda --shape llama-3.2-3b --batch 64   # dummy weights of a shape

One engine (as `disagg up` runs a CPU worker: bf16, one torch thread) decodes `batch` sequences of 128-token prompts
under each sampling setting in turn, round after round (the machine's load falls on all alike): greedy, the OpenAI
default (temperature 1), the CLI's defaults (temperature 0.2, top_p 0.9) and a seeded top-k. Prints each setting's
median decode step and, timed inside it, the sampler's draw (common/engine/sampler.py `Sampler.draw`; on a GPU the
time of its kernels, between CUDA events). On a GPU (async scheduling on) a step launched ahead is timed from its
launch: the figure is the steps' period.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from common.engine import sampler as sampling
from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from benchmarks.engine_steps import PROMPT, decode_steps, tokens
from benchmarks.gpu_engine_vs_hf import make_model, shape_arg

SETTINGS = {
    "greedy": dict(temperature=0),
    "temperature 1 (OpenAI's default)": dict(temperature=1.0),
    "temperature 0.2, top_p 0.9 (the CLI's)": dict(temperature=0.2, top_p=0.9),
    "temperature 0.7, top_k 40, seeded": dict(temperature=0.7, top_k=40, seed=1),
}


def _timed_draws(spent: list):
    """Sampler.draw, wrapped to add its time to `spent`: on the CPU its wall time; on a GPU a pair of CUDA events
    around its kernels (read by _seconds once the round is synced), so the step launched ahead is not synced by the
    timing and the figure is the draw's kernels, not the forward they queue behind."""
    draw = sampling.Sampler.draw

    def timed(self, logits, requests, draws=None):
        if logits.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = draw(self, logits, requests, draws)
            end.record()
            spent.append((start, end))
            return out
        start = time.perf_counter()
        out = draw(self, logits, requests, draws)
        spent.append(time.perf_counter() - start)
        return out
    return timed


def _seconds(timed) -> float:
    if isinstance(timed, tuple):
        timed[1].synchronize()
        return timed[0].elapsed_time(timed[1]) / 1000
    return timed


def _round(engine: LLMEngine, batch: int, steps: int, setting: dict, seed: int, spent: list) -> list[float]:
    """The decode steps of one round (seconds); `spent` keeps only the draws timed inside them."""
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True, **setting)
    for i in range(batch):
        engine.add_request(f"s{time.monotonic_ns()}-{i}", tokens(engine, PROMPT, seed * 1000 + i), params)
    mark = len(spent)

    def keep_decode_draws(decode: bool) -> None:  # a prompt step's draws (its first tokens) are not a decode's
        nonlocal mark
        if not decode:
            del spent[mark:]
        mark = len(spent)
    return decode_steps(engine, keep_decode_draws)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--steps", type=int, default=32, help="decode steps a round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", type=shape_arg, default=None,
                        help="a model shape with dummy weights (benchmarks/gpu_engine_vs_hf.py SHAPES) instead of "
                             "SmolLM2-135M-Instruct's weights")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as shape_dir:
        if args.shape is not None:
            make_model(args.shape, shape_dir, "dummy")
        engine = LLMEngine(EngineConfig(
            model=shape_dir if args.shape else str(default_model_dir()), dtype=args.dtype, device=args.device,
            load_format="dummy" if args.shape else "auto", num_kv_blocks=max(1024, 16 * max(args.batch)),
            enable_prefix_caching=False, max_num_seqs=max(args.batch)))
    spent: list = []
    sampling.Sampler.draw = _timed_draws(spent)
    print(f"{args.shape or 'SmolLM2-135M-Instruct'}, {args.dtype}, {args.device}, {PROMPT}-token prompts, "
          f"{args.steps} decode steps a round, {args.rounds} rounds")
    for batch in args.batch:
        steps = {name: [] for name in SETTINGS}
        draws = {name: [] for name in SETTINGS}
        for r in range(args.rounds):
            for name, sampling_args in SETTINGS.items():
                spent.clear()
                steps[name] += _round(engine, batch, args.steps, sampling_args, r, spent)
                draws[name] += [_seconds(t) for t in spent]
        floor = statistics.median(steps["greedy"])
        for name in SETTINGS:
            step = statistics.median(steps[name])
            draw = statistics.median(draws[name]) if draws[name] else 0.0
            print(f"batch {batch:3d}  {name:40s} step {step * 1e3:7.2f} ms ({step / floor:4.2f}x greedy), "
                  f"draw {draw * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()

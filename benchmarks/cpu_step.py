"""The CPU decode step with the small ops as C kernels (common/engine/cpu_ops.py) against torch's ops, and the
128-token prefill step with the C prefill attention kernel (cpu_attention.c) against the torch path, in one process.

    python -m benchmarks.cpu_step                 # SmolLM2-135M-Instruct, bf16, one torch thread, batch 1 and 8
    python -m benchmarks.cpu_step --rounds 8 --steps 64
    python -m benchmarks.cpu_step --batch --prefill-rounds 40   # the prefill A/B alone

One engine (bf16, one torch thread, as `disagg up` runs a CPU worker on a core of its own) decodes `batch` sequences
of 128-token prompts; its decode steps alternate between the kernels on and off (torch's ops: the path before
them), so the machine's load falls on both alike. Prints each side's median step, its spread (25th-75th
percentile) and the ratio of medians. Then the same again with timers around the ops' calls inside the step (the
timers cost both sides alike): the ms a step spends in each. Inside a step, after the GEMMs have streamed the
weights through the caches, the ops run slower than alone in a loop, and C SiLU * up is faster than torch's only
there (alone: 4.9 against 5.8 us for one row, 15.8 against 14.0 for eight).

The prefill A/B: one 128-token prompt a step (a new one each time), the prefill attention kernel on and off
alternating step by step (the small ops' kernels and the decode kernel on for both), the step and, timed inside it,
the attention (TorchPagedAttention.attend: the kernel, or the blocks' gather and SDPA).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch

from common.engine import cpu_attention, cpu_linear, cpu_ops, kernels as dispatch
from common.engine.attention import TorchPagedAttention
from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import LLMEngine
from common.engine.models import llama
from common.engine.quantization.kv_cache import KvCacheFormat
from common.engine.request import SamplingParams
from benchmarks.engine_steps import PROMPT, decoding, tokens


@contextmanager
def kernels(on: bool):
    """The C kernels on, or off (every `applies` false: kernels/__init__ dispatches to torch's ops)."""
    applies = cpu_ops.applies
    if not on:
        cpu_ops.applies = lambda x: False
    try:
        yield
    finally:
        cpu_ops.applies = applies


def _spread(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=4)
    return f"{statistics.median(samples):.2f} ms ({q[0]:.2f}-{q[2]:.2f}, n={len(samples)})"


# op -> (module or class, attribute) whose calls make it up: with the kernels on, and off (the torch path ropes in the
# model and the attention backend writes K/V). A name the model imported is wrapped where the model looks it up.
OPS: dict[str, dict[bool, list[tuple[object, str]]]] = {
    "add + RMSNorm": {on: [(dispatch, "add_rms_norm"), (dispatch, "rms_norm"), (llama, "add_rms_norm"),
                           (llama, "rms_norm")] for on in (True, False)},
    "RoPE + K/V write": {True: [(llama, "rope_store_kv")],
                         False: [(llama, "apply_rope"), (llama.RotaryEmbedding, "forward"), (KvCacheFormat, "write")]},
    "SiLU * up": {on: [(dispatch, "silu_and_mul")] for on in (True, False)},
    "GEMMs": {on: [(cpu_linear._PackedForward, "__call__")] for on in (True, False)},
    "attention": {on: [(cpu_attention, "decode")] for on in (True, False)},
}


@contextmanager
def timers(targets: dict[str, list[tuple[object, str]]], spent: dict[str, float]):
    """Timers around the calls of each op's (owner, attribute)s, adding seconds to spent[op]."""
    originals = []
    for op, attributes in targets.items():
        for owner, name in attributes:
            original = getattr(owner, name)
            originals.append((owner, name, original))

            def timed(*args, _op=op, _original=original, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    spent[_op] += time.perf_counter() - start
            setattr(owner, name, timed)
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def decode_steps(engine: LLMEngine, batch: int, steps: int, rounds: int,
                 timed: bool) -> dict[bool, list[dict[str, float]]]:
    """Per decode step, kernels on (True) and off, alternating step by step: {"step": ms} and, when timed, the ms
    of each op (OPS)."""
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    sampling = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for r in range(rounds):
        for i in range(batch):
            engine.add_request(f"{timed}-{r}-{i}", tokens(engine, PROMPT, r * batch + i), sampling)
        on = r % 2 == 0
        while engine.has_unfinished_requests():
            decode = decoding(engine)
            spent: dict[str, float] = defaultdict(float)
            with kernels(on), (timers({op: sides[on] for op, sides in OPS.items()}, spent) if timed else nullcontext()):
                start = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - start
            if decode:
                results[on].append({"step": 1e3 * elapsed, **{op: 1e3 * spent[op] for op in OPS}})
                on = not on
    return results


@contextmanager
def prefill_kernel(on: bool):
    """The C prefill attention kernel on, or off (the torch path: each prefill's blocks gathered, then SDPA)."""
    applies = cpu_attention.prefill_applies
    if not on:
        cpu_attention.prefill_applies = lambda q, k_cache: False
    try:
        yield
    finally:
        cpu_attention.prefill_applies = applies


def prefill_steps(engine: LLMEngine, rounds: int) -> dict[bool, list[dict[str, float]]]:
    """Per 128-token prefill step, the prefill kernel on (True) and off, alternating: {"step": ms, "attention": ms}."""
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    sampling = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            prompt = [3 + (104729 * (2 * r + on) + 31 * j) % (engine.vocab_size - 3) for j in range(PROMPT)]
            engine.add_request(f"prefill-{r}-{on}", prompt, sampling)
            spent: dict[str, float] = defaultdict(float)
            with timers({"attention": [(TorchPagedAttention, "attend")]}, spent), prefill_kernel(on):
                start = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - start
            while engine.has_unfinished_requests():
                engine.step()
            results[on].append({"step": 1e3 * elapsed, "attention": 1e3 * spent["attention"]})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8], help="decode batches (none: no decode A/B)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps of each round's sequences")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prefill-rounds", type=int, default=20, help="prefill steps on and off each (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model=str(default_model_dir()), dtype="bfloat16", num_kv_blocks=1024,
                                    enable_prefix_caching=False, max_num_seqs=max(args.batch, default=1)))
    assert cpu_ops.applies(torch.zeros(1, dtype=torch.bfloat16)), "the C kernels are not built here"
    if args.prefill_rounds:
        prefill_steps(engine, 1)  # warm: the first steps of a fresh engine run slower
        sides = prefill_steps(engine, args.prefill_rounds)
        print("| 128-token prefill step, bf16, 1 thread | prefill kernel off: median (p25-p75) | on | on / off |")
        print("| --- | --- | --- | --- |")
        for part in ("step", "attention"):
            off, on = ([r[part] for r in sides[side]] for side in (False, True))
            print(f"| {part} | {_spread(off)} | {_spread(on)} | {statistics.median(on) / statistics.median(off):.3f} |")
        print()
    if not args.batch:
        return
    print("| decode step, bf16, 1 thread | kernels off: median (p25-p75) | kernels on | on / off |")
    print("| --- | --- | --- | --- |")
    for batch in args.batch:
        steps = {on: [r["step"] for r in rs] for on, rs in decode_steps(engine, batch, args.steps, args.rounds,
                                                                        timed=False).items()}
        ratio = statistics.median(steps[True]) / statistics.median(steps[False])
        print(f"| batch {batch}, {PROMPT}-token contexts | {_spread(steps[False])} | {_spread(steps[True])} "
              f"| {ratio:.3f} |")
    print("\n| ms of a step in each op (timers inside the step; medians) | batch | kernels off | kernels on |")
    print("| --- | --- | --- | --- |")
    for batch in args.batch:
        timed = decode_steps(engine, batch, args.steps, args.rounds, timed=True)
        for side in timed.values():
            for r in side:
                r["other (step less the above)"] = r["step"] - sum(r[op] for op in OPS)
        for op in ["step", *OPS, "other (step less the above)"]:
            off, on = (statistics.median(r[op] for r in timed[side]) for side in (False, True))
            print(f"| {op} | {batch} | {off:.2f} | {on:.2f} |")


if __name__ == "__main__":
    main()

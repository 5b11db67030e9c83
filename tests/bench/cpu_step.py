"""The CPU decode step with the small ops as C kernels (common/engine/cpu_ops.py) against torch's ops, in one process.

    python -m tests.bench.cpu_step                 # SmolLM2-135M-Instruct, bf16, one torch thread, batch 1 and 8
    python -m tests.bench.cpu_step --rounds 8 --steps 64

One engine (bf16, one torch thread, as `disagg up` runs a CPU worker on a core of its own) decodes `batch` sequences
of 128-token prompts; its decode steps alternate between the kernels on and off (torch's ops: the path before
them), so the machine's load falls on both alike. Prints each side's median step, its spread (25th-75th
percentile) and the ratio of medians; then each op alone at the model's shapes, times its calls in a forward.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from common.engine import cpu_ops
from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import LLMEngine
from common.engine.kernels import reference
from common.engine.request import SamplingParams

PROMPT = 128


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


def decode_steps(engine: LLMEngine, batch: int, steps: int, rounds: int) -> dict[bool, list[float]]:
    """Decode step times (ms), kernels on (True) and off, alternating step by step."""
    times: dict[bool, list[float]] = {True: [], False: []}
    sampling = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for r in range(rounds):
        for i in range(batch):
            prompt = [3 + (7919 * (r * batch + i) + 13 * j) % (engine.vocab_size - 3) for j in range(PROMPT)]
            engine.add_request(f"r{r}-{i}", prompt, sampling)
        on = r % 2 == 0
        while engine.has_unfinished_requests():
            decoding = not engine.scheduler.waiting and all(
                q.num_computed_tokens >= q.num_prompt_tokens for q in engine.scheduler.running)
            with kernels(on):
                start = time.perf_counter()
                engine.step()
                elapsed = 1e3 * (time.perf_counter() - start)
            if decoding:
                times[on].append(elapsed)
                on = not on
    return times


def _op_ms(fn: Callable[[], object], repeat: int = 200) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def op_table(engine: LLMEngine, rows: int) -> list[tuple[str, float, float]]:
    """(op, torch ms, C ms) for a forward's calls of each op at `rows` tokens."""
    c = engine.runner.hf_config
    layers, hidden = c.num_hidden_layers, c.hidden_size
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, hidden // c.num_attention_heads
    bf16 = torch.bfloat16
    x, res, w = torch.randn(rows, hidden, dtype=bf16), torch.randn(rows, hidden, dtype=bf16), torch.randn(hidden)
    w = w.to(bf16)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, dtype=bf16)
    cos_sin = engine.runner.model.model.rotary_emb.cos_sin_cache(bf16)
    positions = torch.arange(PROMPT, PROMPT + rows)
    cache = torch.zeros(2, 64, 16, hkv, d, dtype=bf16)
    slots = torch.arange(rows) * 7
    ops = {
        "add + RMSNorm": (2 * layers + 1, lambda impl: impl.add_rms_norm(x, res, w, c.rms_norm_eps)),
        "RoPE + K/V write": (layers, lambda impl: impl.rope_store_kv(qkv, positions, cos_sin, cache[0], cache[1],
                                                                     slots, hq, hkv, d)),
    }
    return [(name, calls * _op_ms(lambda: op(reference)), calls * _op_ms(lambda: op(cpu_ops)))
            for name, (calls, op) in ops.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=32, help="decode steps of each round's sequences")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model=str(default_model_dir()), dtype="bfloat16", num_kv_blocks=1024,
                                    enable_prefix_caching=False, max_num_seqs=max(args.batch)))
    assert cpu_ops.applies(torch.zeros(1, dtype=torch.bfloat16)), "the C kernels are not built here"
    print("| decode step, bf16, 1 thread | kernels off: median (p25-p75) | kernels on | on / off |")
    print("| --- | --- | --- | --- |")
    for batch in args.batch:
        times = decode_steps(engine, batch, args.steps, args.rounds)
        ratio = statistics.median(times[True]) / statistics.median(times[False])
        print(f"| batch {batch}, {PROMPT}-token contexts | {_spread(times[False])} | {_spread(times[True])} "
              f"| {ratio:.3f} |")
    print("\n| a forward's calls of each op | rows | torch ms | C ms |")
    print("| --- | --- | --- | --- |")
    for batch in args.batch:
        for name, torch_ms, c_ms in op_table(engine, batch):
            print(f"| {name} | {batch} | {torch_ms:.2f} | {c_ms:.2f} |")


if __name__ == "__main__":
    main()

"""FP8 weights and the FP8 KV cache on the CPU: SmolLM2-135M-Instruct, bf16 compute, one torch thread (as
`disagg up` runs a CPU worker on a core of its own).

    python -m tests.bench.fp8_cpu [--rounds 3] [--batch 1 8] [--prompt 512]

For each configuration (bf16; --quantization fp8: linear weights FP8 in memory, dequantised on every call;
--kv-cache-dtype fp8: the C decode kernel reads the FP8 cache through its table) it reports the linear layers'
weight bytes, the decode step time at each batch size (prompts of 128 tokens, 32 steps; median step), the prefill
rate of one --prompt-token prompt, and for that prompt's session the bytes a handoff moves and the in-process
export (gather to host) and import (scatter into the cache) times. Rounds alternate the configurations so the
machine's load falls on each alike; each figure is the median over rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import LLMEngine
from common.engine.quantization.fp8_linear import Fp8Linear
from common.engine.request import RequestType, SamplingParams

CONFIGS = {"bf16": {}, "fp8 weights": {"quantization": "fp8"}, "fp8 kv": {"kv_cache_dtype": "fp8"}}
DECODE_STEPS = 32


def _linear_bytes(engine: LLMEngine) -> int:
    layers = [m for m in engine.runner.model.modules() if isinstance(m, (torch.nn.Linear, Fp8Linear))]
    return sum(p.numel() * p.element_size() for m in layers for p in m.parameters())


def _decode_step_ms(engine: LLMEngine, batch: int) -> float:
    prompts = [[100 + 7 * i + j for j in range(128)] for i in range(batch)]
    sampling = SamplingParams(temperature=0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", prompt, sampling)
    steps = []
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running) \
            and not engine.scheduler.waiting
        start = time.perf_counter()
        engine.step()
        if decoding:
            steps.append(time.perf_counter() - start)
    return 1e3 * statistics.median(steps)


def _prefill_and_handoff(engine: LLMEngine, prompt_tokens: int) -> dict[str, float]:
    prompt = [100 + (13 * j) % 20000 for j in range(prompt_tokens)]
    engine.add_request(f"p{time.monotonic_ns()}", prompt, SamplingParams(temperature=0, max_tokens=2),
                       RequestType.CONTEXT_ONLY)
    start, outputs = time.perf_counter(), []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    prefill_s = time.perf_counter() - start
    session = engine.sessions.get(outputs[-1].session_id)
    start = time.perf_counter()
    kv = engine.export_session(session.session_id)
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    engine.runner.import_blocks(session.block_ids, kv)  # back into the same blocks: the scatter a decode worker runs
    import_s = time.perf_counter() - start
    engine.release_session(session.session_id)
    return {"prefill tok/s": prompt_tokens / prefill_s, "handoff MB": kv.blocks.nbytes / 1e6,
            "export ms": 1e3 * export_s, "import ms": 1e3 * import_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = str(default_model_dir())
    engines = {name: LLMEngine(EngineConfig(model=model, dtype="bfloat16", num_kv_blocks=256,
                                            enable_prefix_caching=False, **extra))  # every round computes
               for name, extra in CONFIGS.items()}
    results: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            figures = {f"decode step ms, batch {b}": _decode_step_ms(engine, b) for b in args.batch}
            figures.update(_prefill_and_handoff(engine, args.prompt))
            for key, value in figures.items():
                results[name].setdefault(key, []).append(value)
    keys = list(next(iter(results.values())))
    print("| | linear weights MB | " + " | ".join(keys) + " |")
    print("| --- " * (len(keys) + 2) + "|")
    for name, figures in results.items():
        row = [f"{_linear_bytes(engines[name]) / 1e6:.1f}"] + [f"{statistics.median(figures[k]):.2f}" for k in keys]
        print(f"| {name} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()

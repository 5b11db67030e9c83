"""FP8 weights and the FP8 KV cache against bf16: decode step time, prefill rate, and what a session's handoff moves.

    python -m benchmarks.fp8                          # the CPU: SmolLM2-135M-Instruct, one torch thread
    python -m benchmarks.fp8 --device cuda --shape llama-3.2-3b --batch 1 64
    python -m benchmarks.fp8 --device cuda --shape llama-3.1-8b --batch 1 64

For each configuration (bf16; --quantization fp8; --kv-cache-dtype fp8; both) it reports the bytes of the model's
weights (what a decode step reads), the decode step time at each batch size (prompts of 128 tokens, 32 steps; the
median step) and on CUDA batch 1's step against the roofline of those bytes at the measured HBM bandwidth, the
prefill rate of one --prompt-token prompt, and for that prompt's session the bytes a handoff moves and the
in-process export (gather to host) and import (scatter into the cache) times. --shape takes a shape of
benchmarks/gpu_engine_vs_hf.py (or a directory with a config.json) with --load-format dummy weights. Rounds
alternate the configurations so the machine's load falls on each alike; each figure is the median over rounds.
On the CPU the engine runs one torch thread, as `disagg up` runs a CPU worker on a core of its own.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import LLMEngine
from common.engine.request import RequestType, SamplingParams
from benchmarks.engine_steps import decode_step_ms, sync, tokens

CONFIGS = {"bf16": {}, "fp8 weights": {"quantization": "fp8"}, "fp8 kv": {"kv_cache_dtype": "fp8"},
           "fp8 both": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}


def _weight_bytes(engine: LLMEngine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def _prefill_and_handoff(engine: LLMEngine, prompt_tokens: int) -> dict[str, float]:
    prompt = tokens(engine, prompt_tokens, 1000)
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
    sync(engine)
    import_s = time.perf_counter() - start
    engine.release_session(session.session_id)
    return {"prefill tok/s": prompt_tokens / prefill_s, "handoff MB": kv.blocks.nbytes / 1e6,
            "export ms": 1e3 * export_s, "import ms": 1e3 * import_s}


def _model_dir(args: argparse.Namespace, scratch: str) -> tuple[str, str]:
    """(the model directory, its load format): the default model, or a shape's config.json with dummy weights."""
    if args.shape is None:
        return str(default_model_dir()), "auto"
    from benchmarks.gpu_engine_vs_hf import shape_config

    shape_config(args.shape).save_pretrained(scratch)
    return scratch, "dummy"


def _parser() -> argparse.ArgumentParser:
    from benchmarks.gpu_engine_vs_hf import shape_arg

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", type=shape_arg, default=None, help="a model shape, with dummy weights")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    return parser


def main() -> None:
    args = _parser().parse_args()
    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        model, load_format = _model_dir(args, scratch)
        engines = {name: LLMEngine(EngineConfig(model=model, dtype="bfloat16", device=args.device,
                                                num_kv_blocks=args.num_kv_blocks, load_format=load_format,
                                                enable_prefix_caching=False,  # every round computes
                                                max_num_seqs=max(args.batch), **CONFIGS[name]))
                   for name in args.configs}
        results: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                figures = {f"decode step ms, batch {b}": decode_step_ms(engine, b) for b in args.batch}
                figures.update(_prefill_and_handoff(engine, args.prompt))
                for key, value in figures.items():
                    results[name].setdefault(key, []).append(value)
    bandwidth = None
    if cuda:
        from benchmarks.gpu_engine_vs_hf import hbm_bandwidth

        bandwidth = hbm_bandwidth()
        print(f"HBM bandwidth (device-to-device copy): {bandwidth / 1e12:.2f} TB/s")
    keys = list(next(iter(results.values())))
    extra = ["batch-1 roofline ms"] if bandwidth else []
    print("| | weights MB | " + " | ".join(keys + extra) + " |")
    print("| --- " * (len(keys) + len(extra) + 2) + "|")
    for name, figures in results.items():
        weights = _weight_bytes(engines[name])
        row = [f"{weights / 1e6:.1f}"] + [f"{statistics.median(figures[k]):.2f}" for k in keys]
        row += [f"{1e3 * weights / bandwidth:.2f}"] if bandwidth else []
        print(f"| {name} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()

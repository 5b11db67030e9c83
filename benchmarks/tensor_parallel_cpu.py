"""Our engine at several tensor-parallel sizes on this CPU, same prompts, next to TP=1 and the memory roofline.

    python -m benchmarks.tensor_parallel_cpu [--tp 1,3] [--batches 1,8] [--output-tokens 32]

The default SmolLM2-135M-Instruct in float32, greedy, a fixed number of output tokens per request. For each
TP size and batch: decode tokens/s and the mean step time, and that step against the memory roofline (the
whole model's weight bytes over the measured copy bandwidth: every rank reads its share, all from the same
DRAM). The outputs of every TP size are checked equal to TP=1's. On a machine with few cores the ranks share
them, so the figure is TP's cost here (the step sent to each rank, one all-reduce per o_proj and down_proj,
the logits' all-gather), not its speed-up on separate devices; the last column is how much of rank 0's decode
time it spent inside those collectives (waiting for the other ranks included).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import LLMEngine
from common.engine.parallel import TensorParallel
from common.engine.request import SamplingParams
from common.tokenizer import Tokenizer
from benchmarks.engine_vs_hf import copy_bandwidth_gbs, make_prompts


class CollectiveClock:
    """Seconds rank 0 spends in TensorParallel's collectives (this process's ranks: rank 0 only)."""

    def __init__(self):
        self.seconds = 0.0
        for name in ("all_reduce", "all_gather"):
            setattr(TensorParallel, name, self._timed(getattr(TensorParallel, name)))

    def _timed(self, collective):
        def timed(tp: TensorParallel, x: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            try:
                return collective(tp, x)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def run(model_dir: str, tp: int, prompts: list[list[int]], out_tokens: int,
        clock: CollectiveClock) -> tuple[float, float, float, list]:
    """(decode tokens/s, mean step seconds, share of decode time in collectives, outputs) of one batch of prompts
    at one TP size."""
    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=512, max_num_seqs=len(prompts),
                                    tensor_parallel_size=tp))
    try:
        engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        sampling = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, sampling)
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        steps, decode_s, decoded, waited = 0, 0.0, 0, 0.0
        while engine.has_unfinished_requests():
            start, collectives = time.perf_counter(), clock.seconds
            produced = engine.step()
            if produced and all(outputs[o.request_id] for o in produced):  # a decode step: every row had its first
                steps, decode_s, decoded = steps + 1, decode_s + time.perf_counter() - start, decoded + len(produced)
                waited += clock.seconds - collectives
            for out in produced:
                outputs[out.request_id].extend(out.new_token_ids)
        return decoded / decode_s, decode_s / steps, waited / decode_s, [outputs[rid] for rid in ids]
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", default="1,3", help="TP sizes, comma-separated (SmolLM2's 3 KV heads: 1 or 3)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--output-tokens", type=int, default=32)
    args = parser.parse_args()
    model_dir = str(default_model_dir())
    clock = CollectiveClock()
    sizes, batches = [int(t) for t in args.tp.split(",")], [int(b) for b in args.batches.split(",")]
    prompts = make_prompts(Tokenizer.from_model_dir(model_dir), max(batches))
    weights = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=1)).runner.model.state_dict().values()
    weight_bytes = sum({t.data_ptr(): t.numel() * t.element_size() for t in weights}.values())  # tied: once
    step_floor = weight_bytes / (copy_bandwidth_gbs() * 1e9)
    print(f"SmolLM2-135M float32, {os.cpu_count()} cores, {args.output_tokens} output tokens a request, greedy; "
          f"roofline step {step_floor * 1e3:.2f} ms ({weight_bytes / 1e6:.0f} MB of weights)")
    print("| TP | batch | decode tok/s | step ms | × roofline step | vs TP=1 tok/s | outputs = TP=1 | in collectives |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for batch in batches:
        base = None
        for tp in sizes:
            tok_s, step_s, waited, outputs = run(model_dir, tp, prompts[:batch], args.output_tokens, clock)
            base = base or (tok_s, outputs)
            print(f"| {tp} | {batch} | {tok_s:.1f} | {step_s * 1e3:.1f} | {step_s / step_floor:.1f}× | "
                  f"{tok_s / base[0]:.2f}× | {'yes' if outputs == base[1] else 'NO'} | {waited:.0%} |", flush=True)


if __name__ == "__main__":
    main()

"""A decode worker whose KV pool cannot hold every handoff at full length: the growth reserve against admitting while
blocks last (vLLM's rule), in one process, rounds alternating.

    python -m benchmarks.kv_growth_reserve                      # SmolLM2-135M-Instruct, bf16, one torch thread
    python -m benchmarks.kv_growth_reserve --requests 12 --pool-requests 6.5 --prompt 256 --output 64

A prefill engine computes `--requests` prompts (context_only) once; each round a decode engine whose pool holds
`--pool-requests` of them at full length (prompt + output) takes every handoff at once (generation_only, the KV
copied in as a gRPC or shm pull leaves it) and decodes them to the end. For each setting it prints the round's wall
time, output tok/s, the decode steps' p50 / p99 / longest, the preemptions and the prompt tokens the decode engine
computed (a preempted handoff's prompt is computed again there: the floor is 0), and the outputs' agreement with
the first round's (greedy: every setting must give the same tokens).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import LLMEngine
from common.engine.request import RequestType, SamplingParams
from benchmarks.engine_steps import tokens


def _handoffs(prefill: LLMEngine, prompts: list[list[int]], sampling: SamplingParams) -> list[tuple]:
    """(prompt, its KV export, first token) of each prompt, computed once."""
    firsts = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"p{i}", prompt, sampling, RequestType.CONTEXT_ONLY)
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            firsts[out.request_id] = out
    return [(prompt, prefill.export_session(firsts[f"p{i}"].session_id), firsts[f"p{i}"].new_token_ids[0])
            for i, prompt in enumerate(prompts)]


def _round(config: EngineConfig, handoffs: list[tuple], sampling: SamplingParams) -> dict:
    decode = LLMEngine(config)
    computed = [0]
    run_step = decode.runner.run_step

    def counted(step, ids=None):  # prompt positions computed here: a preempted handoff's prompt, again
        computed[0] += sum(q for q, c in zip(step.layout.query_lens, step.layout.context_lens) if q > 1)
        return run_step(step, ids)
    decode.runner.run_step = counted
    start = time.perf_counter()
    for i, (prompt, export, first) in enumerate(handoffs):
        decode.add_request(f"d{i}", prompt, sampling, RequestType.GENERATION_ONLY, kv_import=export,
                           first_token=first)
    outputs: dict[str, list[int]] = {}
    steps = []
    while decode.has_unfinished_requests():
        began = time.perf_counter()
        for out in decode.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps.append(time.perf_counter() - began)
    wall = time.perf_counter() - start
    return {"wall": wall, "tok_s": sum(map(len, outputs.values())) / wall, "steps": steps,
            "preemptions": decode.num_preemptions, "recomputed": computed[0],
            "outputs": [outputs[f"d{i}"] for i in range(len(handoffs))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--pool-requests", type=float, default=4.5,
                        help="full-length requests the decode pool holds")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reserves", default="0,256", help="--kv-growth-reserve values to compare (tokens)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = EngineConfig(model=str(default_model_dir()), dtype="bfloat16", enable_prefix_caching=False,
                        max_num_seqs=args.requests, num_kv_blocks=1024)
    sampling = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    prefill = LLMEngine(base)
    handoffs = _handoffs(prefill, [tokens(prefill, args.prompt, i) for i in range(args.requests)], sampling)
    blocks = int(args.pool_requests * -(-(args.prompt + args.output) // base.block_size))
    print(f"SmolLM2-135M-Instruct, bf16, one thread: {args.requests} handoffs of {args.prompt} prompt tokens, "
          f"{args.output} output each, into a decode pool of {blocks} blocks ({args.pool_requests} at full length)")
    reserves = [int(r) for r in args.reserves.split(",")]
    results: dict[int, list[dict]] = {r: [] for r in reserves}
    for _ in range(args.rounds):
        for reserve in reserves:
            results[reserve].append(_round(base.replace(num_kv_blocks=blocks, kv_growth_reserve=reserve),
                                           handoffs, sampling))
    reference = results[reserves[0]][0]["outputs"]
    for reserve, rounds in results.items():
        steps = sorted(s for r in rounds for s in r["steps"])
        p99 = steps[min(len(steps) - 1, int(0.99 * len(steps)))]
        print(f"--kv-growth-reserve {reserve:4d}: wall {statistics.median(r['wall'] for r in rounds):6.2f} s, "
              f"{statistics.median(r['tok_s'] for r in rounds):6.1f} tok/s, steps p50 "
              f"{statistics.median(steps) * 1e3:6.1f} / p99 {p99 * 1e3:6.1f} / max {steps[-1] * 1e3:6.1f} ms, "
              f"preemptions {rounds[0]['preemptions']}, prompt tokens recomputed {rounds[0]['recomputed']}, "
              f"outputs {'equal' if all(r['outputs'] == reference for r in rounds) else 'DIFFER'}")


if __name__ == "__main__":
    main()

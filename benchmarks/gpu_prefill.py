"""One prompt's prefill on a GPU: our engine against Hugging Face transformers (SDPA) and the bf16 matmul peak.

    python -m benchmarks.gpu_prefill --model llama-3.2-3b --load-format dummy --lengths 512,1280,2048 \
        --profile-dir OUT

A prefill worker's time to first token is its queue plus this compute, so this is what one prefill GPU can serve.
For each prompt length: the median of `--reps` engine steps that prefill one fresh prompt and sample its first token
(max_tokens=1, as a context-only request), next to
- HF `model(input_ids, logits_to_keep=1)` in bf16 with SDPA attention, the same weights' shape (its own random init),
- the physical limit: the prefill's FLOPs (2 × weights' multiply-adds per token, the causal attention's two
  matmuls, one token's LM head) at the bf16 matmul rate measured here (an 8192³ cuBLAS matmul, best of 10).
`--profile-dir` writes the kernels of one engine prefill at the middle length, by GPU time (torch.profiler).

`--stream N` (a prefill worker under a full queue): N prompts of uniform 512-2048 tokens queued at once, steps of
`--stream-budget` tokens: prompt tokens/s, and the share of the wall its kernels kept the GPU busy, with the next prompt
step launched before the last one's first tokens are read (async scheduling) and without.

`--mixed-batch B` (an aggregated worker's step): B requests decode at `--mixed-context` tokens while prompts of 2048
tokens prefill beside them in chunks, the step's budget `--mixed-budget` tokens (--max-num-batched-tokens). Prints the
median decode-only step and the median step that carries a chunk, each as wall time (engine.step and a device sync)
and the GPU time of its kernels (torch.profiler, 16 more steps): the difference is time the GPU waited for the host.
Then the mean step run back to back (no sync between steps): with async scheduling, the next step is launched before
this one's tokens are read, and the host's part of a step hides behind the GPU's.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import RequestType, SamplingParams
from benchmarks.engine_steps import decoding
from benchmarks.gpu_engine_vs_hf import emit, engine_for, make_model, shape_arg, shape_config


def matmul_peak_flops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    best = float("inf")
    for _ in range(12):
        torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def prefill_flops(config, tokens: int) -> float:
    """Multiply-adds × 2 of a causal prefill of `tokens` fresh tokens that samples the last one."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_token = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)
    attention = layers * 2 * config.num_attention_heads * head_dim * tokens * (tokens + 1) / 2  # QK^T and PV, causal
    return 2 * (per_token * tokens + attention + h * config.vocab_size)


def engine_prefill_s(engine, length: int, reps: int, tag: str) -> float:
    times = []
    for i in range(reps + 1):
        engine.add_request(f"{tag}-{length}-{i}", [1000 + (i * 7 + j) % 100000 for j in range(length)],
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()  # the sampled token is read back: synchronised
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])  # the first: this length's kernel shapes compile


def hf_prefill_s(model, length: int, reps: int) -> float:
    ids = torch.arange(1000, 1000 + length, device="cuda").unsqueeze(0)
    times = []
    with torch.inference_mode():
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model(ids, logits_to_keep=1).logits.argmax(-1).item()
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def kernel_table(engine, length: int, path: str) -> None:
    engine.add_request("profiled", list(range(2000, 2000 + length)),
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
    table = write_kernel_table(prof, path)
    print(f"kernels of one {length}-token prefill:\n" + "\n".join(table.splitlines()[:24]), flush=True)


def write_kernel_table(prof, path: str) -> str:
    """The profiled kernels by GPU time (the top 30), written to `path` (its folder made if missing) and returned."""
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=80)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(table)
    return table


def mixed_steps(model_dir: str, load_format: str, batch: int, context: int, budget: int, steps: int,
                profile_dir: str | None = None) -> dict:
    """Decode-only steps of `batch` requests, then steps that also carry a chunk of a 2048-token prompt (one always
    prefilling): each kind's median wall, and its kernels' GPU time a step over 16 more steps under torch.profiler
    (their table by GPU time in `profile_dir`, when given)."""
    # The first prompts decode while the last ones prefill (batch × context / budget steps): none may finish
    # before the measured steps are over, or the batch is smaller than asked.
    max_tokens = batch * context // budget + 2 * steps + 128
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", device="cuda", block_size=16,
                                    num_kv_blocks=(batch * (context + max_tokens) + 4 * 2048) // 16 + 64,
                                    max_num_seqs=batch + 1, max_num_batched_tokens=budget,
                                    max_model_len=max(context + max_tokens, 2048 + 1), enable_prefix_caching=False,
                                    load_format=load_format))
    for i in range(batch):
        engine.add_request(f"dec{i}", [1000 + (i * 31 + j) % 100000 for j in range(context)],
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while not decoding(engine):
        engine.step()
    prompts = 0

    def advance(mixed: bool) -> None:
        nonlocal prompts
        if mixed and decoding(engine):  # no prompt left prefilling: start the next
            prompts += 1
            engine.add_request(f"chunked{prompts}", [2000 + (prompts * 17 + j) % 100000 for j in range(2048)],
                               SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        engine.step()

    def step(mixed: bool) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        advance(mixed)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    decoding_rows = len(engine.scheduler.running)
    assert decoding_rows == batch, f"{decoding_rows} of {batch} requests decoding"
    out = {"batch": batch, "context": context, "budget": budget}
    for kind, mixed in (("decode", False), ("mixed", True)):
        for _ in range(8):
            step(mixed)
        out[f"{kind}_wall_s"] = statistics.median(step(mixed) for _ in range(steps))
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):  # no sync between steps: what launching the next step ahead (async scheduling) hides
            advance(mixed)
        torch.cuda.synchronize()
        out[f"{kind}_period_s"] = (time.perf_counter() - t) / steps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(16):
                step(mixed)
        out[f"{kind}_kernels_s"] = sum(e.self_device_time_total for e in prof.key_averages()) / 16 / 1e6
        if profile_dir:
            write_kernel_table(prof, f"{profile_dir}/{kind}_step_b{batch}_kernels.txt")
    return out  # (its engine goes with this frame: the caller's free_gpu)


def stream_prefill(model_dir: str, load_format: str, prompts: int, budget: int, seed: int = 0) -> dict:
    """A prefill worker's engine under a full queue: `prompts` context_only prompts of uniform 512-2048 tokens
    queued at once, each session released as its first token comes, steps of at most `budget` tokens
    (--max-num-batched-tokens); once with the next prompt step launched before the last one's tokens are read (async
    scheduling, the default on CUDA), once without. Each run's wall time, steps, and the GPU time of its kernels
    (torch.profiler, a third pass): wall minus kernels is time the GPU waited for the host."""
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(512, 2048) for _ in range(prompts)]
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", device="cuda", block_size=16,
                                    num_kv_blocks=sum(lengths) // 16 + prompts + 64, max_num_seqs=128,
                                    max_num_batched_tokens=budget, max_model_len=4096, enable_prefix_caching=False,
                                    load_format=load_format))

    def run(tag: str) -> tuple[float, int]:
        for i, n in enumerate(lengths):
            engine.add_request(f"{tag}{i}", [1000 + (i * 13 + j) % 100000 for j in range(n)],
                               SamplingParams(temperature=0, max_tokens=16), RequestType.CONTEXT_ONLY)
        torch.cuda.synchronize()
        t, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                engine.release_session(out.session_id)
            steps += 1
        torch.cuda.synchronize()
        return time.perf_counter() - t, steps

    result = {"prompts": prompts, "budget": budget, "prompt_tokens": sum(lengths)}
    for ahead in (True, False):
        engine.async_scheduling = ahead
        run("warm")
        wall, steps = run("timed")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run("profiled")
        kernels = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
        result["ahead" if ahead else "synchronous"] = {"wall_s": wall, "steps": steps, "kernels_s": kernels}
    return result  # (its engine goes with this frame: the caller's free_gpu)


def free_gpu() -> None:
    """Give back the memory of an engine a function above made and dropped (its KV cache), before the next one."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=shape_arg, default="llama-3.2-3b")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="dummy")
    parser.add_argument("--lengths", default="512,1024,1280,2048")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--profile-dir")
    parser.add_argument("--mixed-batch", type=int, default=0, help="0: no mixed-step figure")
    parser.add_argument("--mixed-context", type=int, default=1024)
    parser.add_argument("--mixed-budget", type=int, default=512)
    parser.add_argument("--mixed-steps", type=int, default=200)
    parser.add_argument("--stream", type=int, default=0,
                        help="also: this many prompts of 512-2048 tokens queued at once, a prefill worker's steps "
                             "(--stream-budget tokens each): prompt tokens/s and the GPU's busy share")
    parser.add_argument("--stream-budget", type=int, default=2048)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: it times the engine's steps on one")
    lengths = [int(x) for x in args.lengths.split(",")]
    peak = emit("bf16_matmul_peak", flops_per_s=matmul_peak_flops(), device=torch.cuda.get_device_name())["flops_per_s"]
    config = shape_config(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        make_model(args.model, model_dir, args.load_format)
        engine = engine_for(model_dir, max_num_seqs=8, num_blocks=max(lengths) // 16 * 2 + 64,
                            load_format=args.load_format)
        for length in lengths:
            rows.append({"tokens": length, "ours_s": engine_prefill_s(engine, length, args.reps, "p")})
        if args.profile_dir:
            kernel_table(engine, lengths[len(lengths) // 2], f"{args.profile_dir}/prefill_kernels.txt")
        del engine
        torch.cuda.empty_cache()
        if args.mixed_batch:
            m = emit("mixed_step", model=args.model, **mixed_steps(model_dir, args.load_format, args.mixed_batch,
                                                                   args.mixed_context, args.mixed_budget,
                                                                   args.mixed_steps, args.profile_dir))
            free_gpu()
            for kind in ("decode", "mixed"):
                print(f"{kind} step at batch {args.mixed_batch}, budget {args.mixed_budget}: wall "
                      f"{m[kind + '_wall_s'] * 1e3:.2f} ms, kernels {m[kind + '_kernels_s'] * 1e3:.2f} ms "
                      f"(median of {args.mixed_steps} steps; kernels over 16 more), back to back "
                      f"{m[kind + '_period_s'] * 1e3:.2f} ms a step", flush=True)
        if args.stream:
            r = emit("prefill_stream", model=args.model, **stream_prefill(model_dir, args.load_format, args.stream,
                                                                         args.stream_budget))
            free_gpu()
            for mode in ("ahead", "synchronous"):
                m = r[mode]
                print(f"{r['prompts']} prompts queued, steps of <= {r['budget']} tokens, {mode}: "
                      f"{r['prompt_tokens'] / m['wall_s']:,.0f} prompt tok/s, {r['prompts'] / m['wall_s']:.1f} "
                      f"prompts/s, {m['wall_s'] / m['steps'] * 1e3:.2f} ms a step; the GPU busy "
                      f"{m['kernels_s'] / m['wall_s']:.0%} of the wall (kernels under the profiler)", flush=True)
    if not args.skip_hf:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        model = model.cuda().eval()
        for row in rows:
            row["hf_s"] = hf_prefill_s(model, row["tokens"], args.reps)
        del model
    print("\n| prompt tokens | ours (ms) | HF SDPA (ms) | FLOP limit (ms) | ours / limit | ours TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        flops = prefill_flops(config, row["tokens"])
        limit = flops / peak
        emit("prefill", model=args.model, **row, flops=flops, limit_s=limit)
        hf = f"{row['hf_s'] * 1e3:.2f}" if "hf_s" in row else "-"
        print(f"| {row['tokens']} | {row['ours_s'] * 1e3:.2f} | {hf} | {limit * 1e3:.2f} | "
              f"{row['ours_s'] / limit:.2f} | {flops / row['ours_s'] / 1e12:.0f} |")


if __name__ == "__main__":
    main()

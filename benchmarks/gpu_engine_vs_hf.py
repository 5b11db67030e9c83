"""Our engine on a GPU vs Hugging Face transformers on the same work, next to the HBM roofline.

    python -m benchmarks.gpu_engine_vs_hf --model qwen2.5-0.5b     # or llama-3.2-1b; --quick for a smoke run
    python -m benchmarks.gpu_engine_vs_hf --model llama-3.2-1b --skip-hf --skip-hf-continuous   # roofline figures
    python -m benchmarks.gpu_engine_vs_hf --model llama-3.1-8b --load-format dummy --skip-hf   # no checkpoint

Random-weight models with the shapes of Qwen2.5-0.5B / Llama-3.2-1B in bf16 (configs built here, no
download; --model may also name a directory holding any shape's config.json). --load-format dummy writes only the
config and the engine makes its weights on the GPU (HF then runs its own random init of the config).
Work: N requests (default 256) with input and output lengths uniform in [100, 1024], random token ids, ignore_eos.
Prints, as one JSON line per figure and a table at the end:
- our engine's output-token throughput on all N requests, and on the first `--hf-requests` of them
  next to HF `generate` (static batches of `--hf-batch`, left padded, each batch run to its longest
  output; only each request's own output tokens are counted) and HF continuous batching (`generate_batch`);
- batch-1 inter-token latency (engine step and bare CUDA-graph replay) next to weight bytes / HBM bandwidth,
  for the model and for each of `--itl-shapes` (default the Llama-3.2-3B shape);
- decode-step bandwidth at batch `--decode-batch`: (weights + KV read) / step time, as a fraction of HBM bandwidth.
HBM bandwidth is measured here: a device-to-device copy, bytes read + written per second.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, LlamaConfig, PretrainedConfig, Qwen2Config

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.model_runner import StepLaunch
from common.engine.request import SamplingParams

SHAPES = {
    "qwen2.5-0.5b": lambda: Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "llama-3.2-1b": lambda: LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
    "llama-3.2-3b": lambda: LlamaConfig(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-8b": lambda: _llama31(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32),
    "llama-3.1-70b": lambda: _llama31(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                      num_attention_heads=64),
}
def _llama31(**shape) -> LlamaConfig:
    """A Llama-3.1 shape (8B, 70B): 8 KV heads of 128, 128k vocabulary, llama3 RoPE scaling, untied head."""
    return LlamaConfig(vocab_size=128256, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                            "factor": 8.0, "low_freq_factor": 1.0,
                                                            "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 8192},
                       tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001, **shape)


def shape_arg(text: str) -> str:
    if text in SHAPES or (Path(text) / "config.json").is_file():
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a shape ({', '.join(sorted(SHAPES))}) nor a directory "
                                     "with a config.json")


TARGETS = {"llama-3.2-1b": 1.5, "llama-3.2-3b": 1.3}  # batch-1 ITL / roofline, at most
DECODE_TARGET = 0.60  # batch-64 decode step: fraction of HBM bandwidth, at least


def emit(name: str, **fields) -> dict:
    record = {"figure": name, **fields}
    print(json.dumps(record), flush=True)
    return record


def hbm_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (best of 10)."""
    src = torch.empty(2**30, dtype=torch.uint16, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(12):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / best


def shape_config(shape: str) -> PretrainedConfig:
    """A SHAPES name's config, or that of a directory holding a config.json (any shape)."""
    return SHAPES[shape]() if shape in SHAPES else AutoConfig.from_pretrained(shape)


def model_figures(config: PretrainedConfig) -> tuple[int, int]:
    """(weight bytes read per decode step in bf16, KV bytes per token), counted on the meta device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied embedding counted once
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return weight_bytes, config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2


def make_model(shape: str, directory: str, load_format: str = "auto") -> tuple[int, int]:
    """Saves a random bf16 model (load_format dummy: its config.json alone, the engine makes the weights);
    returns (weight bytes read per decode step, KV bytes per token)."""
    config = shape_config(shape)
    if load_format == "dummy":
        config.save_pretrained(directory)
        return model_figures(config)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied embedding counted once
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2
    del model
    torch.cuda.empty_cache()
    return weight_bytes, kv_per_token


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(1000, vocab - 1000) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
            for _ in range(n)]


def engine_for(model_dir: str, max_num_seqs: int, num_blocks: int, tp: int = 1,
               load_format: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", device="cuda", block_size=16,
                                  num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                                  max_model_len=4096, enable_prefix_caching=False, tensor_parallel_size=tp,
                                  load_format=load_format))


def run_engine(engine: LLMEngine, work: list[tuple[list[int], int]]) -> tuple[float, int]:
    """All requests at once; returns (seconds, output tokens)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(work):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt,
                           SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def batch1_itl(engine: LLMEngine, prompt_len: int, steps: int) -> dict:
    """Mean engine step time of one decoding request, and the bare graph replay of batch 1."""
    engine.add_request("itl", list(range(1000, 1000 + prompt_len)),
                       SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    engine.step()  # prefill
    engine.step()
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()  # the sampled token is read back: a full step, synchronised
        times.append(time.perf_counter() - t)
    return {"engine_step_s": sum(times) / len(times), "graph_replay_s": graph_replay_s(engine, 1, steps)}


def graph_replay_s(engine: LLMEngine, bucket: int, steps: int) -> float | None:
    """Mean time of the bucket's CUDA graph replayed back to back over the metadata of the last step run."""
    graphs = engine.runner.graphs
    if graphs is None or bucket not in graphs.graphs:
        return None
    graph = graphs.graphs[bucket]
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def start_decoding(engine: LLMEngine, batch: int, ctx: int, steps: int) -> None:
    """`batch` requests of `ctx` prompt tokens and `steps` + 4 output tokens each, stepped until all of them decode."""
    for i in range(batch):
        engine.add_request(f"dec{i}", list(range(1000 + i, 1000 + i + ctx)),
                           SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    engine.step()


def decode_bandwidth(engine: LLMEngine, batch: int, ctx: int, steps: int, weight_bytes: int, kv_per_token: int) -> dict:
    start_decoding(engine, batch, ctx, steps)
    times, kv_read = [], []
    breakdown = emit("step_breakdown", **step_breakdown(engine, batch, 8))
    while engine.has_unfinished_requests():
        live = sum(r.num_tokens for r in engine.requests.values())
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        kv_read.append(live * kv_per_token)
    times, kv_read = times[:-1], kv_read[:-1]  # the last step finishes every request
    step = sum(times) / len(times)
    return {"step_s": step, "bytes_per_step": weight_bytes + sum(kv_read) / len(kv_read),
            "graph_replay_s": graph_replay_s(engine, batch, steps), "breakdown": breakdown}


def step_breakdown(engine: LLMEngine, batch: int, steps: int) -> dict:
    """Where a decode step's wall time goes, at `batch` running requests (call while they decode): the
    scheduler, the runner up to the graph launch (host metadata and copies; with async scheduling the launch
    of the step after this one), the wait for this step's tokens (GPU time the host did not overlap), and the
    engine's own bookkeeping (the rest)."""
    runner, scheduler = engine.runner, engine.scheduler
    spent = {"schedule": 0.0, "prepare_and_launch": 0.0, "wait_for_tokens": 0.0}

    def timed(key, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t
        return wrapper

    result = StepLaunch.result
    scheduler.schedule = timed("schedule", scheduler.schedule)
    runner.launch = timed("prepare_and_launch", runner.launch)
    runner.launch_ahead = timed("prepare_and_launch", runner.launch_ahead)
    StepLaunch.result = timed("wait_for_tokens", StepLaunch.result)
    total = 0.0
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            total += time.perf_counter() - t
    finally:
        del scheduler.schedule, runner.launch, runner.launch_ahead  # back to the classes' own methods
        StepLaunch.result = result
    parts = {k: v / steps for k, v in spent.items()}
    return {"batch": batch, "step_s": total / steps, **{f"{k}_s": v for k, v in parts.items()},
            "engine_rest_s": total / steps - sum(parts.values())}


def kernel_profile(engine: LLMEngine, bucket: int, path: str) -> None:
    """Per-kernel GPU time of a few eager decode forwards over the bucket's static buffers (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.runner.graphs
    try:
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graphs._forward(bucket)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
    except Exception as exc:  # a diagnostic: report, never lose the figures after it
        print(f"kernel profile failed: {type(exc).__name__}: {exc}", flush=True)
        return
    with open(path, "w") as f:
        f.write(table)
    print(f"kernel profile, batch {bucket} (5 forwards):\n" + "\n".join(table.splitlines()[:16]), flush=True)


def gemv_choices() -> list[dict]:
    """What the batch-1 linear layers run: the Triton GEMV where it timed no slower, inside a CUDA graph, than
    cuBLAS with the prologue as its own kernel."""
    from common.engine.kernels import gemv

    return [{"n": k[0], "k": k[1], "prologue": k[4], "gemv_us": round(c.ours_us, 2), "cublas_us": round(c.cublas_us, 2),
             "uses_gemv": c.uses_gemv} for k, c in gemv.choices.items()]


def itl_of_shape(shape: str, bw: float, steps: int, load_format: str = "auto") -> dict:
    """Batch-1 ITL of another model shape (its own random checkpoint and engine), next to its roofline."""
    with tempfile.TemporaryDirectory() as model_dir:
        weight_bytes, _ = make_model(shape, model_dir, load_format)
        engine = engine_for(model_dir, max_num_seqs=1, num_blocks=4096 // 16 + 8, load_format=load_format)
        batch1_itl(engine, 64, 8)  # warm-up
        emit("gemv_choices", model=shape, shapes=gemv_choices())
        itl = batch1_itl(engine, 512, steps)
        del engine
    torch.cuda.empty_cache()
    roofline = weight_bytes / bw
    return emit("batch1_itl", model=shape, weight_bytes=weight_bytes, **itl, roofline_s=roofline,
                engine_vs_roofline=itl["engine_step_s"] / roofline,
                graph_vs_roofline=(itl["graph_replay_s"] or float("nan")) / roofline)


def summary(itls: list[dict], dec: dict) -> None:
    """The roofline figures against their targets, as a table (printed last)."""
    print("\n| figure | measured | roofline / HBM | ratio | target |")
    print("| --- | --- | --- | --- | --- |")
    for r in itls:
        target = TARGETS.get(r["model"])
        ok = "" if target is None else f"≤ {target}× {'✓' if r['engine_vs_roofline'] <= target else '✗'}"
        print(f"| {r['model']} batch-1 ITL, engine step | {r['engine_step_s'] * 1e3:.3f} ms | "
              f"{r['roofline_s'] * 1e3:.3f} ms | {r['engine_vs_roofline']:.2f}× | {ok} |")
        if r["graph_replay_s"] is not None:
            print(f"| {r['model']} batch-1 CUDA graph replay | {r['graph_replay_s'] * 1e3:.3f} ms | "
                  f"{r['roofline_s'] * 1e3:.3f} ms | {r['graph_vs_roofline']:.2f}× | |")
    frac = dec["fraction_of_hbm"]
    print(f"| {dec['model']} decode step, batch {dec['batch']} × {dec['context']} ctx | {dec['step_s'] * 1e3:.3f} ms |"
          f" {dec['bytes_per_step'] / 1e9:.2f} GB | {frac:.1%} of HBM bw | ≥ {DECODE_TARGET:.0%} "
          f"{'✓' if frac >= DECODE_TARGET else '✗'} |")
    if dec.get("graph_fraction_of_hbm"):
        print(f"| {dec['model']} same step, CUDA graph replay | {dec['graph_replay_s'] * 1e3:.3f} ms | | "
              f"{dec['graph_fraction_of_hbm']:.1%} of HBM bw | |")


@torch.inference_mode()
def hf_static(model, work: list[tuple[list[int], int]], batch: int) -> tuple[float, int]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(chunk):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        longest = max(n for _, n in chunk)
        model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=longest,
                       min_new_tokens=longest, do_sample=False, pad_token_id=0)
        tokens += sum(n for _, n in chunk)
    torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


@torch.no_grad()  # generate_batch updates its own buffers in place: inference tensors refuse that
def hf_continuous(model, work: list[tuple[list[int], int]]) -> tuple[float, int]:
    """generate_batch takes one max_new_tokens: the longest output, counted for every request (its own work)."""
    longest = max(n for _, n in work)
    config = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=[p for p, _ in work], generation_config=config)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.generated_tokens) for o in outputs.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=shape_arg, default="qwen2.5-0.5b",
                        help=f"one of {sorted(SHAPES)}, or a directory holding a config.json")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: write only the config; the engine makes random weights on the GPU")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--hf-requests", type=int, default=32, help="the subset HF runs (it is slow)")
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-hf-continuous", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few requests")
    parser.add_argument("--profile-dir", help="write per-kernel GPU time tables (torch.profiler) here")
    parser.add_argument("--itl-shapes", default="llama-3.2-3b",
                        help="comma-separated other shapes whose batch-1 ITL is measured too ('' for none)")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.hf_requests, args.hf_batch, args.decode_batch = 16, 8, 8, 8
    bw = hbm_bandwidth()
    emit("hbm_copy_bandwidth", bytes_per_s=bw, device=torch.cuda.get_device_name())
    with tempfile.TemporaryDirectory() as model_dir:
        weight_bytes, kv_per_token = make_model(args.model, model_dir, args.load_format)
        roofline = weight_bytes / bw
        emit("model", model=args.model, weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token,
             batch1_roofline_s=roofline)
        vocab = shape_config(args.model).vocab_size
        work = workload(args.requests, 0, vocab)
        t = time.perf_counter()
        engine = engine_for(model_dir, max_num_seqs=256, num_blocks=256 * 2048 // 16 + 64,
                            load_format=args.load_format)
        emit("engine_startup", seconds=time.perf_counter() - t, cuda_graph_buckets=engine.runner.graphs.buckets)
        emit("gemv_choices", model=args.model, shapes=gemv_choices())
        run_engine(engine, workload(4, 99, vocab))  # warm-up: prefill kernel shapes, allocator
        seconds, tokens = run_engine(engine, work)
        ours_all = emit("ours_throughput", requests=len(work), seconds=seconds, output_tokens=tokens,
                        tok_per_s=tokens / seconds)
        subset = work[: args.hf_requests]
        seconds, tokens = run_engine(engine, subset)
        ours_sub = emit("ours_throughput_hf_subset", requests=len(subset), seconds=seconds, output_tokens=tokens,
                        tok_per_s=tokens / seconds)
        itl = batch1_itl(engine, 512, 128)
        engine.add_request("breakdown", list(range(1000, 1512)), SamplingParams(temperature=0, max_tokens=20,
                                                                              ignore_eos=True))
        engine.step()
        emit("step_breakdown", **step_breakdown(engine, 1, 16))
        while engine.has_unfinished_requests():
            engine.step()
        if args.profile_dir:
            kernel_profile(engine, 1, f"{args.profile_dir}/kernels_batch1.txt")
        itls = [emit("batch1_itl", model=args.model, **itl, roofline_s=roofline,
                     engine_vs_roofline=itl["engine_step_s"] / roofline,
                     graph_vs_roofline=(itl["graph_replay_s"] or float("nan")) / roofline)]
        dec = decode_bandwidth(engine, args.decode_batch, 1000, 64, weight_bytes, kv_per_token)
        graph_fraction = dec["bytes_per_step"] / dec["graph_replay_s"] / bw if dec["graph_replay_s"] else None
        dec = emit("decode_step_bandwidth", model=args.model, batch=args.decode_batch, context=1000, **dec,
                   fraction_of_hbm=dec["bytes_per_step"] / dec["step_s"] / bw, graph_fraction_of_hbm=graph_fraction)
        if args.profile_dir:
            kernel_profile(engine, args.decode_batch, f"{args.profile_dir}/kernels_batch{args.decode_batch}.txt")
        del engine
        torch.cuda.empty_cache()
        for shape in filter(None, args.itl_shapes.split(",")):
            itls.append(itl_of_shape(shape, bw, 128, args.load_format))
        summary(itls, dec)
        if args.skip_hf:
            return
        model = (AutoModelForCausalLM.from_config(shape_config(model_dir), dtype=torch.bfloat16)
                 if args.load_format == "dummy" else
                 AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)).cuda().eval()
        hf_static(model, workload(2, 98, vocab), 2)  # warm-up
        seconds, tokens = hf_static(model, subset, args.hf_batch)
        hf = emit("hf_generate_static", requests=len(subset), batch=args.hf_batch, seconds=seconds,
                  output_tokens=tokens, tok_per_s=tokens / seconds)
        emit("ratio_ours_vs_hf_generate", value=ours_sub["tok_per_s"] / hf["tok_per_s"],
             ours_all_vs_hf=ours_all["tok_per_s"] / hf["tok_per_s"])
        if args.skip_hf_continuous:
            return
        try:
            seconds, tokens = hf_continuous(model, subset)
        except Exception as exc:  # report, not crash: the API moves between transformers versions
            emit("hf_generate_batch", error=f"{type(exc).__name__}: {exc}"[:500])
            return
        cb = emit("hf_generate_batch", requests=len(subset), seconds=seconds, output_tokens=tokens,
                  tok_per_s=tokens / seconds)
        emit("ratio_ours_vs_hf_generate_batch", value=ours_sub["tok_per_s"] / cb["tok_per_s"])


if __name__ == "__main__":
    main()

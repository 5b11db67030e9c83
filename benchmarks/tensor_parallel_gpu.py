"""Tensor parallelism on two GPUs of one host: TP=2 next to TP=1 in the same run, on a random-weight model of a real
shape (bf16), against the memory roofline, plus the KV handoff between worker processes across TP sizes.

- batch 1: the engine's decode step (graphs and async scheduling on), against the roofline of the weight bytes one
  GPU reads (all of them at TP=1, half at TP=2), and the share of a step the NCCL kernels take (torch.profiler);
- batch 64: the decode step's bytes (weights + the KV read) per second, as a fraction of the GPUs' HBM bandwidth
  (one GPU's at TP=1, two at TP=2);
- the handoff: a 1500-token session pulled over cuda_ipc by real workers, prefill TP=1 / TP=2 into decode TP=1 /
  TP=2 (Usage's kv_transfer_bytes / kv_transfer_ms, median of 10).

    python -m benchmarks.tensor_parallel_gpu [--model llama-3.2-3b]      # on a machine with two GPUs
    python -m benchmarks.tensor_parallel_gpu --model llama-3.1-8b --load-format dummy   # no checkpoint written
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import grpc
import torch

from benchmarks.gpu_engine_vs_hf import (SHAPES, emit, engine_for, hbm_bandwidth, make_model, shape_arg,
                                         start_decoding)
from benchmarks.processes import start_services, stop_cleanly
from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.kit.serving import channel_options

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the machine's rule: no NVLink multicast (the followers inherit it)


def decode_steps(engine: LLMEngine, batch: int, ctx: int, steps: int) -> tuple[list[float], int]:
    """Wall time of each decode step of `batch` requests of `ctx` prompt tokens (after their prefill), and the
    tokens the batch holds on average over those steps."""
    start_decoding(engine, batch, ctx, steps)
    times, live = [], []
    while engine.has_unfinished_requests():
        live.append(sum(r.num_tokens for r in engine.requests.values()))
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times[:-1], int(sum(live) / len(live))


def batch1_profile(engine: LLMEngine, steps: int) -> dict:
    """Rank 0's GPU over `steps` batch-1 decode steps (torch.profiler): the fraction of the wall time some kernel
    runs (below 1: the host holds the GPU back), the share of kernel time in NCCL's, and the costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    engine.add_request("prof", list(range(1000, 1512)), SamplingParams(temperature=0, max_tokens=steps + 4,
                                                                       ignore_eos=True))
    engine.step()
    engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    busy, reach = 0.0, float("-inf")
    for begin, end in kernels:  # the union of the kernels' intervals
        busy += max(0.0, end - max(begin, reach))
        reach = max(reach, end)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) or 1.0
    nccl = sum(e.self_device_time_total for e in events if "nccl" in e.key.lower())
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:6]
    return {"gpu_busy_fraction": round(busy / wall_us, 3), "nccl_share_of_kernel_time": round(nccl / total, 3),
            "nccl_us_per_step": round(nccl / (steps + 2), 1),
            "top_kernels_us_per_step": {e.key[:60]: round(e.self_device_time_total / (steps + 2), 1) for e in top}}


def engine_figures(model_dir: str, tp: int, weight_bytes: int, kv_per_token: int, bw: float, steps: int,
                   load_format: str = "auto") -> dict:
    engine = engine_for(model_dir, max_num_seqs=64, num_blocks=3072, tp=tp, load_format=load_format)
    try:
        itl = statistics.mean(decode_steps(engine, 1, 512, steps)[0])
        roofline = weight_bytes / tp / bw
        times, live = decode_steps(engine, 64, 512, 32)
        step = statistics.mean(times)
        step_bytes = weight_bytes + live * kv_per_token
        profiled = batch1_profile(engine, 32)
    finally:
        engine.close()
    return emit(f"tp{tp}", batch1_itl_ms=round(itl * 1e3, 3), roofline_ms=round(roofline * 1e3, 3),
                x_roofline=round(itl / roofline, 2), **profiled, batch64_step_ms=round(step * 1e3, 3),
                batch64_hbm_fraction=round(step_bytes / step / (tp * bw), 3))


def handoff(prefill: grpc.Channel, decode: grpc.Channel, prompt: list[int],
            max_tokens: int = 4) -> common_pb2.Finished:
    """One request prefilled on `prefill` and decoded on `decode` (which pulls its KV session): its Finished."""
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens)
    prefilled = worker_pb2_grpc.PrefillerStub(prefill).Prefill(
        worker_pb2.PrefillRequest(request_id="r", token_ids=prompt, sampling=sampling), timeout=60)
    start = worker_pb2.DecodeStart(request_id="r", token_ids=prompt, first_token=prefilled.first_token,
                                   stop=common_pb2.StopConditions(ignore_eos=True), sampling=sampling)
    start.session.CopyFrom(prefilled.session)
    messages = list(worker_pb2_grpc.DecoderStub(decode).Decode(iter([worker_pb2.DecodeClientMessage(start=start)]),
                                                                timeout=120))
    return messages[-1].finished


def handoffs(model_dir: str, prompt_len: int, repeats: int, load_format: str = "auto") -> None:
    """Sessions pulled over cuda_ipc between real workers at every pair of TP sizes in {1, 2}."""
    base = ("--model", model_dir, "--device", "cuda", "--dtype", "bfloat16", "--block-size", "16",
            "--num-kv-blocks", "512", "--max-model-len", "4096", "--no-prefix-caching", "--load-format", load_format)
    tp2 = ("--tensor-parallel-size", "2")
    ipc = ("--kv-transports", "cuda_ipc")
    specs = [("prefill", base), ("prefill", (*base, *tp2)), ("decode", (*base, *ipc)), ("decode", (*base, *tp2, *ipc))]
    processes = start_services(specs, timeout_s=600)
    try:
        channels = [grpc.insecure_channel(p.address, options=channel_options()) for p in processes]
        for (pi, ptp), (di, dtp) in [((0, 1), (2, 1)), ((0, 1), (3, 2)), ((1, 2), (2, 1)), ((1, 2), (3, 2))]:
            seconds, size = [], 0
            for i in range(repeats):  # token exactness across TP sizes: tests/gpu/test_tensor_parallel_gpu.py
                prompt = [1000 + (i * 7 + t) % 50000 for t in range(prompt_len)]
                finished = handoff(channels[pi], channels[di], prompt)
                size = finished.usage.kv_transfer_bytes
                seconds.append(finished.usage.kv_transfer_ms / 1e3)
            median = statistics.median(seconds)
            emit("handoff", prefill_tp=ptp, decode_tp=dtp, tokens=prompt_len, bytes=size,
                 pull_ms=round(median * 1e3, 3), gb_per_s=round(size / median / 1e9, 1))
    finally:
        stop_cleanly(processes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=shape_arg, default="llama-3.2-3b",
                        help=f"one of {sorted(SHAPES)}, or a directory holding a config.json")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: write only the config; every rank makes its share of random weights on its GPU")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--handoff-tokens", type=int, default=1500)
    parser.add_argument("--skip-handoff", action="store_true")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two CUDA GPUs")
    bw = hbm_bandwidth()
    emit("hbm", gb_per_s=round(bw / 1e9))
    with tempfile.TemporaryDirectory() as model_dir:
        weight_bytes, kv_per_token = make_model(args.model, model_dir, args.load_format)
        emit("model", shape=args.model, weight_gb=round(weight_bytes / 1e9, 2))
        for tp in (1, 2):
            engine_figures(model_dir, tp, weight_bytes, kv_per_token, bw, args.steps, args.load_format)
        if not args.skip_handoff:
            handoffs(model_dir, args.handoff_tokens, 10, args.load_format)


if __name__ == "__main__":
    main()

"""Engine throughput next to Hugging Face transformers `generate` on the same prompts (CPU).

    python -m benchmarks.engine_vs_hf [--requests 32] [--output-tokens 64]

Both run the default SmolLM2-135M-Instruct in float32, greedy, a fixed number of output tokens
per request. HF gets its best static shape: all requests in one left-padded batch. The memory
roofline is the decode step's floor, weight bytes / measured copy bandwidth, times the batch.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM

from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from common.tokenizer import Tokenizer

TOPICS = ["the sea", "a lighthouse", "GPUs", "bread", "winter", "a cat", "the moon", "trains"]


def make_prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content":
            f"Write {i % 5 + 1} sentences about {TOPICS[i % len(TOPICS)]}, request {i}."}]) for i in range(n)]


def bench_engine(model_dir: str, prompts: list[list[int]], out_tokens: int) -> float:
    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=512, max_num_seqs=len(prompts)))
    sampling = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, sampling)
    elapsed = time.perf_counter() - start
    return sum(map(len, outputs)) / elapsed


@torch.inference_mode()
def bench_hf(model_dir: str, prompts: list[list[int]], out_tokens: int, pad_id: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=out_tokens, min_new_tokens=out_tokens,
                  pad_token_id=pad_id)
    model.generate(ids[:2], **{**kwargs, "attention_mask": mask[:2], "max_new_tokens": 4, "min_new_tokens": 4})
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    elapsed = time.perf_counter() - start
    return (out.shape[0] * (out.shape[1] - width)) / elapsed


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * 2 * nbytes / (time.perf_counter() - start) / 1e9  # read + write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    args = parser.parse_args()
    model_dir = str(default_model_dir())
    tokenizer = Tokenizer.from_model_dir(model_dir)
    prompts = make_prompts(tokenizer, args.requests)
    print(f"SmolLM2-135M float32, CPU threads={torch.get_num_threads()} cores={os.cpu_count()}, "
          f"{args.requests} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.output_tokens} output tokens each, greedy")
    ours = bench_engine(model_dir, prompts, args.output_tokens)
    hf = bench_hf(model_dir, prompts, args.output_tokens, pad_id=tokenizer.hf.pad_token_id or 0)
    weight_bytes = sum(p.numel() * p.element_size() for p in
                       AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).parameters())
    bandwidth = copy_bandwidth_gbs()
    roofline = args.requests * bandwidth * 1e9 / weight_bytes
    print(f"{'disagg engine':<34} {ours:9.1f} tokens/s")
    print(f"{'HF transformers generate (batch)':<34} {hf:9.1f} tokens/s")
    print(f"{'ratio engine / HF':<34} {ours / hf:9.2f}x")
    print(f"{'memory roofline (weights/step)':<34} {roofline:9.1f} tokens/s "
          f"({weight_bytes / 1e6:.0f} MB weights, {bandwidth:.1f} GB/s copy bandwidth); engine at {ours / roofline:.0%}")


if __name__ == "__main__":
    main()

"""Engine flags shared by every process that runs an engine (run, prefill, decode, and `disagg up`,
which passes them on to its workers)."""
from __future__ import annotations

import argparse
import os

from common.engine.config import CPU_LONG_PREFILL_TOKENS, ENGINES, EngineConfig
from common.engine.default_model import resolve_model

# (flag, attribute) of every valued engine flag, in the order `engine_argv` writes them.
_VALUED = (("--model", "model"), ("--dtype", "dtype"), ("--device", "device"), ("--block-size", "block_size"),
           ("--num-kv-blocks", "num_kv_blocks"), ("--gpu-memory-utilization", "gpu_memory_utilization"),
           ("--max-num-seqs", "max_num_seqs"), ("--max-num-batched-tokens", "max_num_batched_tokens"),
           ("--long-prefill-token-threshold", "long_prefill_token_threshold"),
           ("--max-model-len", "max_model_len"), ("--max-waiting", "max_waiting"), ("--session-ttl", "session_ttl"),
           ("--engine", "engine"), ("--tensor-parallel-size", "tensor_parallel_size"))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--engine", default=os.environ.get("DISAGG_ENGINE", "torch"), choices=list(ENGINES),
                   help="torch (ours, runs everywhere) or trtllm (TensorRT-LLM's LLM API, needs NVIDIA's TensorRT-LLM "
                        "image; unverified on hardware) (env DISAGG_ENGINE)")
    g.add_argument("--model", default=os.environ.get("DISAGG_MODEL"),
                   help="Hugging Face model directory, or 'default' for SmolLM2-135M-Instruct (env DISAGG_MODEL)")
    g.add_argument("--dtype", default=os.environ.get("DISAGG_DTYPE", "float32"),
                   choices=["float32", "float16", "bfloat16"])
    g.add_argument("--device", default=os.environ.get("DISAGG_DEVICE", "cpu"))
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=int(os.environ.get("DISAGG_NUM_KV_BLOCKS", 1024)),
                   help="KV cache blocks (ignored with --gpu-memory-utilization)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA only: size the KV cache to fill this fraction of the GPU's memory after the weights "
                        "are loaded (e.g. 0.9), instead of --num-kv-blocks")
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="most prompt tokens of one request per step, so a long prompt shares steps with the "
                        f"others (default: {CPU_LONG_PREFILL_TOKENS} on the CPU, no limit on CUDA)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-waiting", type=int, default=1024, help="queued requests before RESOURCE_EXHAUSTED")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--enforce-eager", action="store_true", help="GPU: run decode steps without CUDA graphs")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="GPU: read each decode step's tokens before launching the next (default: launch ahead)")
    g.add_argument("--tensor-parallel-size", type=int,
                   default=int(os.environ.get("DISAGG_TENSOR_PARALLEL_SIZE", 1)),
                   help="shard the model over this many ranks, one process each (must divide its attention and "
                        "KV heads; --device cpu, over gloo) (env DISAGG_TENSOR_PARALLEL_SIZE)")
    g.add_argument("--session-ttl", type=float, default=float(os.environ.get("DISAGG_SESSION_TTL", 60.0)),
                   help="seconds an exported KV session waits for its pull")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=str(resolve_model(args.model)), dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold, max_model_len=args.max_model_len,
        max_waiting=args.max_waiting,
        enable_prefix_caching=not args.no_prefix_caching, session_ttl_s=args.session_ttl, engine=args.engine,
        enforce_eager=args.enforce_eager, async_scheduling=False if args.no_async_scheduling else None,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def engine_argv(args: argparse.Namespace, **overrides: object) -> list[str]:
    """The engine flags as a command line, so that a child process gets the same engine settings; `overrides`
    (by attribute: device=..., tensor_parallel_size=...) replace a value of `args`, so each flag appears once."""
    unknown = set(overrides) - {name for _, name in _VALUED}
    if unknown:
        raise TypeError(f"engine_argv: no engine flag for {sorted(unknown)}")
    out: list[str] = []
    for flag, name in _VALUED:
        value = overrides[name] if name in overrides else getattr(args, name)
        if value is not None:
            out += [flag, str(value)]
    switches = (("--no-prefix-caching", args.no_prefix_caching), ("--enforce-eager", args.enforce_eager),
                ("--no-async-scheduling", args.no_async_scheduling))
    return out + [flag for flag, on in switches if on]

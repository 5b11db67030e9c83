"""Engine flags shared by every process that runs an engine (run, prefill, decode, and `disagg up`,
which passes them on to its workers), and the one place they merge with --engine-config and --engine-overrides
(services/worker/engine_file.py: defaults < YAML < JSON < flags given)."""
from __future__ import annotations

import argparse
import functools
import json
import os
from collections.abc import Mapping
from typing import Any

from common.engine.spec.config import parse_speculative_config
from common.engine.config import (AUTO_DTYPE, CPU_KV_BLOCKS, CPU_LONG_PREFILL_TOKENS, DEFAULT_GPU_MEMORY_UTILIZATION,
                                  DEFAULT_MAX_NUM_SEQS, DEFAULT_STEP_TOKENS, DTYPES, ENGINES,
                                  GPU_MAX_NUM_SEQS, GPU_STEP_TOKENS, KV_CACHE_DTYPES, LOAD_FORMATS,
                                  QUANTIZATIONS, STRUCTURED_OUTPUT_BACKENDS, EngineConfig, default_max_num_seqs,
                                  default_step_tokens, resolve_dtype)
from common.engine.default_model import resolve_model
from services.worker.engine_file import Given, GivenSwitch, apply_layers, flag_specs, read_json, read_yaml


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine", "each also from --engine-config (keys: flags without --), "
                                  "--engine-overrides")
    g.add_argument("--engine-config", default=os.environ.get("DISAGG_ENGINE_CONFIG") or None, metavar="FILE.yaml",
                   help="YAML of flags (env DISAGG_ENGINE_CONFIG)")
    g.add_argument("--engine-overrides", default=os.environ.get("DISAGG_ENGINE_OVERRIDES") or None, metavar="JSON",
                   help="JSON over it (env DISAGG_ENGINE_OVERRIDES)")
    _add_engine_flags(g)


def _add_engine_flags(g: argparse._ArgumentGroup) -> None:
    """The engine flags proper: each notes itself given (engine_file.Given), so a file's value never beats it."""
    add = functools.partial(g.add_argument, action=Given)
    add("--engine", default=os.environ.get("DISAGG_ENGINE", "torch"), choices=list(ENGINES),
        help="torch (ours, runs everywhere) or trtllm (TensorRT-LLM's LLM API, needs NVIDIA's TensorRT-LLM "
             "image; unverified on hardware) (env DISAGG_ENGINE)")
    add("--model", default=os.environ.get("DISAGG_MODEL"), metavar="DIR",
        help="HF model dir, or 'default' (env DISAGG_MODEL)")
    add("--dtype", default=os.environ.get("DISAGG_DTYPE", AUTO_DTYPE), choices=[AUTO_DTYPE, *DTYPES], metavar="DTYPE",
        help="auto: GPU half, CPU float32 (env DISAGG_DTYPE)")
    add("--device", default=os.environ.get("DISAGG_DEVICE", "cpu"), help="cpu, cuda or cuda:N (env DISAGG_DEVICE)")
    add("--block-size", type=int, default=16, metavar="TOKENS",
        help="tokens a KV block holds (prefix caching, handoffs and the tiers count in blocks)")
    add("--num-kv-blocks", type=int, metavar="N",
        default=int(os.environ["DISAGG_NUM_KV_BLOCKS"]) if os.environ.get("DISAGG_NUM_KV_BLOCKS") else None,
        help=f"KV blocks, CPU {CPU_KV_BLOCKS} (env DISAGG_NUM_KV_BLOCKS)")
    # up divides a GPU's share among the workers on it: each counts only its own weights, activations and KV cache.
    add("--gpu-memory-utilization", type=float, default=None, metavar="F",
        help=f"CUDA: the GPU's share to use (default {DEFAULT_GPU_MEMORY_UTILIZATION})")
    # CUDA runs more rows a step: a decode step there costs about the same for many more.
    add("--max-num-seqs", type=int, default=None, metavar="N",
        help=f"most requests a step (default {DEFAULT_MAX_NUM_SEQS}; CUDA {GPU_MAX_NUM_SEQS})")
    add("--max-num-batched-tokens", type=int, default=None,
        help=f"most tokens a step computes (default: {DEFAULT_STEP_TOKENS}; {GPU_STEP_TOKENS} on CUDA, where prompts "
             "sent together then prefill in one step)")
    add("--long-prefill-token-threshold", type=int, default=None,
        help="most prompt tokens of one request per step, so a long prompt shares steps with the "
             f"others (default: {CPU_LONG_PREFILL_TOKENS} on the CPU, no limit on CUDA)")
    add("--max-model-len", type=int, default=None, metavar="TOKENS",
        help="longest prompt + output a request may take (default: the model's context length)")
    add("--max-waiting", type=int, default=1024, help="queued requests before RESOURCE_EXHAUSTED")
    add("--kv-growth-reserve", type=int, default=256, metavar="TOKENS",
        help="tokens of KV growth a new request (or a handed-off KV) leaves free for each running one, at most "
             "what that one may still generate; it waits for room instead of causing a preemption later "
             "(0: admit while blocks last)")
    add("--no-prefix-caching", action=GivenSwitch,
        help="no reuse of a cached prompt prefix (and no KV events for kv_aware routing)")
    add("--enforce-eager", action=GivenSwitch,
        help="GPU: run every step eagerly, without CUDA graphs (decode steps, and prompt and mixed steps in pieces)")
    add("--no-async-scheduling", action=GivenSwitch,
        help="GPU: read each decode step's tokens before launching the next (default: launch ahead)")
    add("--tensor-parallel-size", type=int, metavar="N",
        default=int(os.environ.get("DISAGG_TENSOR_PARALLEL_SIZE", 1)),
        help="model shards (env DISAGG_TENSOR_PARALLEL_SIZE)")
    add("--session-ttl", type=float, default=float(os.environ.get("DISAGG_SESSION_TTL", 60.0)),
        help="seconds an exported KV session waits for its pull")
    add("--load-format", default="auto", choices=list(LOAD_FORMATS),
        help="auto: the model directory's safetensors; dummy: random weights made on the device from its "
             "config.json alone (tokenizer files still read from it), to run any shape without weights")
    add("--dummy-seed", type=int, default=0,
        help="seed of --load-format dummy's weights (the same seed, the same model)")
    add("--quantization", default=None, choices=list(QUANTIZATIONS),
        help="fp8: quantise an unquantised checkpoint's linear layers to FP8 at load, one scale per output row "
             "(an FP8 checkpoint, Hugging Face's or llm-compressor's, loads as FP8 without it)")
    add("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
        help="auto: the KV cache holds --dtype; fp8: float8_e4m3fn, scale 1.0 (half the bytes of bf16 held and "
             "handed off; a worker of another KV dtype refuses its sessions)")
    add("--structured-output-backend", default=os.environ.get("DISAGG_STRUCTURED_OUTPUT_BACKEND", "auto"),
        choices=list(STRUCTURED_OUTPUT_BACKENDS),
        help="the grammar library of structured output and forced tool calls: xgrammar, guidance (llguidance), or "
             "auto (xgrammar, the faster on a GPU); a grammar the first refuses is tried on the other (env "
             "DISAGG_STRUCTURED_OUTPUT_BACKEND)")
    add("--speculative-config", default=None, metavar="JSON",
        help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4}\' drafts from '
             'each request\'s own prompt and output, \'{"method": "draft", "model": DIR, ...}\' from a smaller model '
             "with the same tokenizer (default: off)")
    add("--host-kv-cache-gb", type=float, default=None, metavar="GB",
        help="host memory (pinned on CUDA) for KV blocks evicted from the GPU, brought back on a prefix hit "
             "instead of recomputed (0: none; not on the CPU, whose KV pool is host memory)")
    add("--disk-kv-cache-dir", default=None, metavar="DIR",
        help="a directory for KV blocks evicted from memory, one verified file a block (with --disk-kv-cache-gb)")
    add("--disk-kv-cache-gb", type=float, default=None, metavar="GB",
        help="the disk tier's budget: the least recently used blocks' files go first")
    add("--kv-cache-write-through", action=GivenSwitch,
        help="store each finished request's full KV blocks in the disk tier at once (a node-wide tier: disagg up "
             "--shared-kv-cache), so another worker's next turn finds them")


def _engine_actions() -> list[argparse.Action]:
    """The engine flags proper (a parser of them alone: its defaults read the environment as it is now)."""
    parser = argparse.ArgumentParser(add_help=False)
    _add_engine_flags(parser.add_argument_group("engine"))
    return [a for a in parser._actions if a.option_strings]


def apply_engine_config(args: argparse.Namespace, *more: tuple[str, Mapping[str, Any]]) -> argparse.Namespace:
    """`args` with every engine flag not given on the command line taken from --engine-config, then
    --engine-overrides, then each (source, layer) of `more` (a later one wins); InvalidConfig names a bad key.
    Changes `args` in place, and may run again: the same layers give the same values."""
    layers = []
    if getattr(args, "engine_config", None):
        layers.append((f"--engine-config {args.engine_config}", read_yaml(args.engine_config)))
    if getattr(args, "engine_overrides", None):
        layers.append(("--engine-overrides", read_json(args.engine_overrides)))
    apply_layers(args, [*layers, *more], flag_specs(_engine_actions()))
    return args


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the flags, merged with --engine-config and --engine-overrides (apply_engine_config); an
    unset step budget is the device's (default_step_tokens)."""
    apply_engine_config(args)
    step_tokens = (args.max_num_batched_tokens if args.max_num_batched_tokens is not None
                   else default_step_tokens(args.device))
    max_num_seqs = args.max_num_seqs if args.max_num_seqs is not None else default_max_num_seqs(args.device)
    model = resolve_model(args.model)
    return EngineConfig(
        model=str(model), dtype=resolve_dtype(args.dtype, args.device, str(model)), device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=step_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold, max_model_len=args.max_model_len,
        max_waiting=args.max_waiting, kv_growth_reserve=args.kv_growth_reserve,
        enable_prefix_caching=not args.no_prefix_caching, session_ttl_s=args.session_ttl, engine=args.engine,
        enforce_eager=args.enforce_eager, async_scheduling=False if args.no_async_scheduling else None,
        tensor_parallel_size=args.tensor_parallel_size, load_format=args.load_format, dummy_seed=args.dummy_seed,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        structured_output_backend=args.structured_output_backend, host_kv_cache_gb=args.host_kv_cache_gb or 0.0,
        disk_kv_cache_dir=args.disk_kv_cache_dir, disk_kv_cache_gb=args.disk_kv_cache_gb or 0.0,
        kv_cache_write_through=args.kv_cache_write_through,
        speculative_config=parse_speculative_config(args.speculative_config),
    )


def effective_engine_json(args: argparse.Namespace, config: EngineConfig) -> str:
    """Every engine flag's value as the engine runs with it, by key (the flag without --), the model directory
    resolved: what Worker/GetInfo shows, and itself a valid --engine-config file."""
    flags = {a.option_strings[-1].removeprefix("--"): _effective(args, config, a.dest) for a in _engine_actions()}
    return json.dumps({**flags, "model": config.model}, sort_keys=True)


def _effective(args: argparse.Namespace, config: EngineConfig, dest: str) -> object:
    """A flag's value; unset, what the config made of it (a default by device and role: the step budget, the batch)."""
    value = getattr(args, dest)
    return getattr(config, dest, None) if value is None else value


def engine_argv(args: argparse.Namespace, **overrides: object) -> list[str]:
    """The engine flags as a command line, so that a child process gets the same engine settings; `overrides`
    (by attribute: device=..., tensor_parallel_size=...) replace a value of `args`, so each flag appears once."""
    actions = _engine_actions()
    unknown = set(overrides) - {a.dest for a in actions if a.nargs != 0}
    if unknown:
        raise TypeError(f"engine_argv: no engine flag for {sorted(unknown)}")
    out: list[str] = []
    for action in actions:
        value = overrides[action.dest] if action.dest in overrides else getattr(args, action.dest)
        if action.nargs == 0:  # a switch
            out += [action.option_strings[-1]] if value else []
        elif value is not None:
            out += [action.option_strings[-1], str(value)]
    return out

"""`disagg run "prompt"`: an engine in this process (through the engine interface, so `--engine trtllm` too),
tokens streamed to the terminal. No servers."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

from common.engine.config import resolve_max_model_len
from common.engine.interface import Engine, EngineRequest
from common.engine.request import SamplingParams, check_fits_context
from common.engine.start import start_engine
from common.errors import DisaggError
from common.model_facts import load_model_facts
from common.text_stream import IncrementalDetokenizer
from common.tokenizer import load_tokenizer
from services.worker.engine_flags import add_engine_args, engine_config_from_args
from services.cli.sampling_flags import add_sampling_args, sampling_from_args


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    s = sampling_from_args(args)
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, repetition_penalty=s.repetition_penalty,
                          max_tokens=s.max_tokens, seed=s.seed)


async def stream(engine: Engine, prompt: list[int], sampling: SamplingParams, text: IncrementalDetokenizer) -> int:
    """Generate, writing the text as it comes; how many tokens were generated."""
    count = 0
    async for out in engine.generate(EngineRequest("run", prompt, sampling)):
        count += len(out.new_token_ids)
        sys.stdout.write(text.add(out.new_token_ids).text)
        sys.stdout.flush()
    sys.stdout.write(text.flush())
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg run", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_sampling_args(parser)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    try:  # every refusal is one line, before the model loads where it can be
        config = engine_config_from_args(args)
        sampling = sampling_params(args)
        tok = load_tokenizer(config.model)
        if tok is None:
            parser.error(f"{config.model} has no tokenizer; `disagg run` needs text")
        prompt = tok.encode(args.prompt) if args.raw else tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}])
        max_positions = load_model_facts(config.model).max_position_embeddings
        if max_positions is not None:
            check_fits_context(len(prompt), sampling.max_tokens, resolve_max_model_len(config, max_positions))
        engine = start_engine(config)
    except (DisaggError, ValueError, FileNotFoundError) as exc:
        print(f"disagg run: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        count = asyncio.run(stream(engine, prompt, sampling, IncrementalDetokenizer(tok, prompt)))
    finally:
        engine.shutdown()
    elapsed = time.perf_counter() - start
    print(f"\n[{count} tokens in {elapsed:.2f}s, {count / elapsed:.1f} tokens/s]", file=sys.stderr)
    return 0

"""`disagg run "prompt"`: the engine in this process, tokens streamed to the terminal. No servers."""
from __future__ import annotations

import argparse
import sys
import time

from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from services.engine_flags import add_engine_args, engine_config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg run", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    engine = LLMEngine(engine_config_from_args(args))
    if engine.tokenizer is None:
        parser.error(f"{engine.config.model} has no tokenizer; `disagg run` needs text")
    tok = engine.tokenizer
    prompt = tok.encode(args.prompt) if args.raw else tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    engine.add_request("run", prompt, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                                     seed=args.seed))
    start, count = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            count += len(out.new_token_ids)
            sys.stdout.write(out.text)
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    print(f"\n[{count} tokens in {elapsed:.2f}s, {count / elapsed:.1f} tokens/s]", file=sys.stderr)
    return 0

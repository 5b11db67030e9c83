"""Structured output's cost: output tok/s of JSON-schema-constrained decoding next to unconstrained decoding, in
the same process on the same engine, rounds alternating which goes first.

    python -m benchmarks.structured_output [--requests 8] [--output-tokens 64] [--rounds 3] [--device cpu]
        [--model DIR [--load-format dummy]] [--dtype bfloat16] [--backend auto,xgrammar,guidance]

The default SmolLM2-135M-Instruct (or `--model`: its shape with random weights where `--load-format dummy`),
greedy, `--requests` chat prompts at once. Each schema asks for an array of at
least 200 strings, so no constrained request can end before --output-tokens; the unconstrained ones ignore EOS: every
run generates the same number of tokens in batches of the same size, and the difference is the grammar's work (its
masks filled, copied and applied each step; on a GPU, with async scheduling, whatever of it the next step's forward
does not hide). `--backend` names the --structured-output-backend settings to compare (each schema runs under each,
in one engine whose grammar compiler is switched between runs); first it prints each setting's compile time for
each schema (a compiler of its own, its tokenizer tables built beforehand, cache cold) and the backend that compiled it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass

from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import LLMEngine
from common.engine.grammar import Grammars
from common.engine.request import SamplingParams
from common.engine.structured import StructuredOutput
from common.tokenizer import Tokenizer

TOPICS = ["fruits", "rivers", "colours", "birds", "cities", "tools", "trees", "metals"]
# At least 200 strings: no request can end before --output-tokens. Strings bounded in length cost xgrammar more: each
# position in one is a state of its own, whose token mask it checks token by token instead of reading a cached one.
SCHEMAS = {
    "strings": {"type": "array", "items": {"type": "string"}, "minItems": 200},
    "maxLength 24": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 200},
}


def make_prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content":
            f"List {TOPICS[i % len(TOPICS)]} as a JSON array of strings, request {i}."}]) for i in range(n)]


@dataclass
class Run:
    outputs: list[list[int]]
    tok_s: float  # output tokens over the wall time
    step_tok_s: float  # the batch's tokens over its median decode step: steady where others' work comes in bursts
    add_ms: float  # add_request for every prompt (a grammar's compile, or its cache hit)
    steps_ms: list[float]  # every engine step, the prefill's first

    def where(self) -> str:
        """Where the wall time went: the adds, the first (prefill) step, the decode steps' median / p90 / max."""
        decode = sorted(self.steps_ms[1:])
        return (f"add {self.add_ms:.1f}, first step {self.steps_ms[0]:.1f}, {len(decode)} steps {sum(decode):.1f} ms "
                f"(median {statistics.median(decode):.2f}, p90 {decode[int(0.9 * len(decode))]:.2f}, "
                f"max {decode[-1]:.2f})")


def compile_times(engine: LLMEngine, backends: list[str]) -> None:
    for backend in backends:
        grammars = Grammars(engine.config.model, engine.vocab_size, engine.eos_token_ids, backend)
        for warm in (StructuredOutput("regex", "x"), StructuredOutput.json_schema({"type": "string", "maxLength": 1})):
            grammars.compile(warm)  # the tokenizer tables of each backend it uses (auto: one each)
        for name, schema in SCHEMAS.items():
            start = time.perf_counter()
            compiled = grammars.compile(StructuredOutput.json_schema(schema))
            print(f"compile {name} under {backend}: {(time.perf_counter() - start) * 1e3:.1f} ms on "
                  f"{compiled.backend}", flush=True)
        grammars.close()


def timed(engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams, backend: str) -> Run:
    engine.grammars.backend = backend
    adding = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
    start = time.perf_counter()  # tok/s from here, as before: the adds are reported on their own
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    steps, every = [], []
    while engine.has_unfinished_requests():
        running, began = engine.num_running, time.perf_counter()
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        every.append((time.perf_counter() - began) * 1e3)
        if running == len(prompts) and not engine.num_waiting:  # a decode step of the whole batch
            steps.append(time.perf_counter() - began)
    elapsed = time.perf_counter() - start
    tokens = sum(map(len, outputs.values()))
    return Run(list(outputs.values()), tokens / elapsed, len(prompts) / statistics.median(steps[1:]),
               (start - adding) * 1e3, every)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default=None, help="a model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--backend", default="auto",
                        help="--structured-output-backend settings to compare, comma-separated (auto, xgrammar, "
                             "guidance)")
    args = parser.parse_args()
    backends = args.backend.split(",")
    model = args.model or str(default_model_dir())
    tokenizer = Tokenizer.from_model_dir(model)
    engine = LLMEngine(EngineConfig(model=model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                                    num_kv_blocks=512, max_num_seqs=args.requests))
    compile_times(engine, backends)
    prompts = make_prompts(tokenizer, args.requests)
    plain = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    runs_of = {"unconstrained": (plain, backends[0])}
    for name, schema in SCHEMAS.items():
        for backend in backends:
            label = name if len(backends) == 1 else f"{name} [{backend}]"
            runs_of[label] = (SamplingParams(temperature=0, max_tokens=args.output_tokens,
                                             structured=StructuredOutput.json_schema(schema)), backend)
            engine.grammars.backend = backend
            engine.generate(prompts[:2], dataclasses.replace(runs_of[label][0], max_tokens=4))  # its compile
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    held_names = [name for name in runs_of if name != "unconstrained"]
    ratios: dict[str, dict[str, list[float]]] = {name: {"tok_s": [], "step_tok_s": []} for name in held_names}
    for round_ in range(args.rounds):
        order = list(runs_of.items())
        runs = {name: timed(engine, prompts, *run) for name, run in (order if round_ % 2 == 0 else order[::-1])}
        free = runs["unconstrained"]
        line = [f"round {round_ + 1}: output tok/s (by the median decode step) unconstrained {free.tok_s:.1f} "
                f"({free.step_tok_s:.1f})"]
        for name in held_names:
            held = runs[name]
            assert all(len(o) == args.output_tokens for o in held.outputs), "a constrained request ended early"
            assert tokenizer.decode(held.outputs[0]).startswith('["'), tokenizer.decode(held.outputs[0])
            for key in ("tok_s", "step_tok_s"):
                ratios[name][key].append(getattr(held, key) / getattr(free, key))
            line.append(f"{name} {held.tok_s:.1f} ({held.step_tok_s:.1f}): {ratios[name]['tok_s'][-1]:.3f}x "
                        f"({ratios[name]['step_tok_s'][-1]:.3f}x)")
        print(", ".join(line), flush=True)
        for name, run in runs.items():
            print(f"  {name}: {run.where()}", flush=True)
    print(f"\n{args.requests} requests x {args.output_tokens} tokens on {args.device} ({args.dtype}), median of "
          f"{args.rounds} rounds, constrained / unconstrained output tok/s (by the median decode step):")
    for name in held_names:
        print(f"  {name}: {statistics.median(ratios[name]['tok_s']):.3f}x "
              f"({statistics.median(ratios[name]['step_tok_s']):.3f}x)")
    print(f"a constrained output begins: {json.dumps(tokenizer.decode(runs[held_names[0]].outputs[0])[:60])}")
    engine.close()


if __name__ == "__main__":
    main()

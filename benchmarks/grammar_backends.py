"""Each grammar backend's compile time and mask-fill time for a few JSON schemas, outside any engine, on the CPU.

    python -m benchmarks.grammar_backends [--model DIR] [--steps 64]

For each schema and backend (common.engine.grammar's own compile, cache cold): the compile's wall time, then one
request's walk through a valid instance of the schema, its text tokenized by the model's tokenizer: before each of
its first --steps tokens the mask is filled into one bitmask row (GrammarMasks.fill, as a step does), timed, and the
token accepted; then a second request's walk on the same compiled grammar (what a library learnt in the first one
kept). Prints the compile ms and each walk's fill median, p90 and max ms per backend: what `auto`'s rule
(common.engine.grammar_choice) is set from.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from common.engine.default_model import default_model_dir
from common.engine.grammar import Grammars
from common.engine.grammar_mask import GrammarMasks
from common.engine.structured import StructuredOutput
from common.model_facts import load_model_facts
from common.tokenizer import load_tokenizer

WORDS = ["apple", "banana", "cherry", "damson", "elder", "fig", "grape", "hazel"]
# Strings near maxLength 24, written in small tokens: every position inside a bounded string is a state of its own.
LONG = ["a river in the far north", "seven quiet grey herons", "dusk over salt marshes", "tall pines by the lake"]
# name → (schema, a valid instance of it)
SCHEMAS = {
    "strings": ({"type": "array", "items": {"type": "string"}, "minItems": 3}, LONG),
    "maxLength 24": ({"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 3}, LONG),
    "pattern": ({"type": "array", "items": {"type": "string", "pattern": "^[a-z]{3,12}$"}}, WORDS),
    "minItems 200": ({"type": "array", "items": {"type": "string"}, "minItems": 200}, WORDS * 25),
    "maxItems 64": ({"type": "array", "items": {"type": "integer"}, "maxItems": 64}, list(range(64))),
    "tool call": ({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["city", "unit", "days"]},
        {"city": "Paris", "unit": "celsius", "days": 3}),
    "object": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["name", "age", "tags"]}, {"name": "Alice", "age": 30, "tags": WORDS[:4]}),
}


def measure(grammars: Grammars, structured: StructuredOutput, tokens: list[int],
            vocab: int) -> tuple[float, list[list[float]]]:
    """The compile's ms, and the fill ms of each token of two requests' walks."""
    start = time.perf_counter()
    compiled = grammars.compile(structured)
    compile_ms = (time.perf_counter() - start) * 1e3
    assert compiled.backend == grammars.backend, f"{grammars.backend} refused it"
    masks, bitmask = GrammarMasks(), torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    walks = []
    for _ in range(2):
        state, fills = compiled.state(), []
        for token in tokens:
            start = time.perf_counter()
            masks.fill([state], bitmask)
            fills.append((time.perf_counter() - start) * 1e3)
            assert state.accept(token), (compiled.backend, structured.spec[:60], token)
        walks.append(sorted(fills))
    return compile_ms, walks


def _figures(fills: list[float]) -> str:
    return f"{statistics.median(fills):.3f} / {fills[int(0.9 * len(fills))]:.3f} / {fills[-1]:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory (its tokenizer and config.json)")
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    model = args.model or str(default_model_dir())
    tokenizer = load_tokenizer(model)
    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    stops = load_model_facts(model).eos_token_ids
    print(f"{model}: {vocab} logits; compile ms, then fill ms a token (median / p90 / max), first request and "
          "second")
    for backend in ("xgrammar", "guidance"):
        grammars = Grammars(model, vocab, stops, backend)
        start = time.perf_counter()
        grammars.compile(StructuredOutput("regex", "x"))  # the tokenizer's tables, apart from any schema's compile
        print(f"{backend}: tokenizer tables {(time.perf_counter() - start) * 1e3:.0f} ms")
        for name, (schema, instance) in SCHEMAS.items():
            text = json.dumps(instance, separators=(", ", ": "))
            tokens = tokenizer.hf.encode(text, add_special_tokens=False)[: args.steps]
            compile_ms, (first, second) = measure(grammars, StructuredOutput.json_schema(schema), tokens, vocab)
            print(f"  {name:>13}: compile {compile_ms:7.1f}, fill {_figures(first)}, again {_figures(second)} "
                  f"({len(first)} tokens)", flush=True)
        grammars.close()


if __name__ == "__main__":
    main()

"""A multi-turn chat against `disagg up` with each KV tier configuration, one after the other, side by side.

    python -m benchmarks.multi_turn [--conversations 8] [--turns 6] [--max-tokens 32] [--think-s 0.5]
        [--num-kv-blocks 64] [--configs none,disk,shared] [--dtype float32] [--host-kv-cache-gb 2]
        [--up-args "--device cuda --model DIR --load-format dummy"] [--ignore-eos] [--json out.json]

Each configuration is one `disagg up`, on the CPU with the default model (SmolLM2-135M-Instruct) unless --up-args
name another model or a GPU, in its default layout (prefill-0 and decode-0; on one GPU the two share it), every
worker's device pool --num-kv-blocks (on CUDA too: --num-kv-blocks without --gpu-memory-utilization sizes the
pool): `none` (no tiers: the device prefix cache alone), `disk` (--disk-kv-cache-dir: a disk tier of its own for
each worker), `shared` (--shared-kv-cache: one directory for both, finished requests written through, so the decode
worker's answer is found by the next turn's prefill), `host` (--host-kv-cache-gb: pinned host memory a worker; on
the CPU the engine runs without it, its pool being host memory) and `host+disk` (both tiers a worker, the host's
victims going to disk). --conversations chats run at once, each --turns turns: a system prompt of its own, then each
turn a new user message over the whole history (every earlier question and answer), sent through the OpenAI door
(chat completions, streaming, greedy, --max-tokens; --ignore-eos: every answer --max-tokens long, for random
weights, which may end an answer anywhere), the answer appended, then a think time (--think-s, ±50%, seeded)
before the next turn. The working set (every conversation's last prompt and answer) is printed against the pool;
the defaults make it over 4x.

Printed per configuration: TTFT mean / p50 / p90 over every turn and over turns 2+ (the turns a cache can serve),
output tok/s (completion tokens over the run's wall time), the prompt tokens the router reported cached and the
workers' disagg_kv_tier_hit_tokens_total; then each configuration against `none` (TTFT: none / it, >= 1 is
faster; tok/s: it / none), and whether every answer is the same as `none`'s, its text and its token count
(greedy: it must be).
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.chat_stream import stream_chat  # noqa: E402
from benchmarks.scrape import scrape_url  # noqa: E402
from benchmarks.threads import timed_in_threads  # noqa: E402
from benchmarks.vllm_cpu import Server, stop_on_sigterm  # noqa: E402
from benchmarks.vllm_gpu import model_id  # noqa: E402
from services.cli.bench.stats import Distribution  # noqa: E402
from services.cli.ports import metrics_ports  # noqa: E402

CONFIGS = {"none": [], "disk": ["--disk-kv-cache-dir", "{dir}/disk", "--disk-kv-cache-gb", "2"],
           "shared": ["--shared-kv-cache", "--disk-kv-cache-dir", "{dir}/shared", "--disk-kv-cache-gb", "2"],
           "host": ["--host-kv-cache-gb", "{host_gb}"],
           "host+disk": ["--host-kv-cache-gb", "{host_gb}", "--disk-kv-cache-dir", "{dir}/host-disk",
                         "--disk-kv-cache-gb", "2"]}
WORDS = ("river stone lantern harbor meadow circuit galaxy orchard violin glacier compass ember canyon theorem "
         "falcon pepper marble thunder willow engine saffron beacon tundra quartz ribbon cobalt prairie anchor "
         "nectar summit fossil cedar lagoon pixel walnut mosaic breeze").split()
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Conversation:
    system: str
    questions: tuple[str, ...]

    def messages(self, turn: int, answers: list[str]) -> list[dict]:
        """The request of turn `turn` (0-based): the system prompt, each earlier question and its answer, the question."""
        history = [{"role": "system", "content": self.system}]
        for question, answer in zip(self.questions[:turn], answers[:turn]):
            history += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return history + [{"role": "user", "content": self.questions[turn]}]


def conversations(n: int, turns: int, seed: int = 58, system_words: int = 110, question_words: int = 40) \
        -> list[Conversation]:
    """`n` conversations of `turns` questions, words drawn from WORDS by `seed`: every system prompt differs from
    its first words on, so no two conversations share a cached prefix."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    return [Conversation(f"You are assistant {i}. Remember these words: {text(system_words)}.",
                         tuple(f"Question {t + 1}: say something about {text(question_words)}." for t in range(turns)))
            for i in range(n)]


def think_times(n: int, turns: int, think_s: float, seed: int = 58) -> list[list[float]]:
    """Each conversation's pause after each turn: think_s ±50%, the same for every configuration."""
    rng = random.Random(seed + 1)
    return [[think_s * rng.uniform(0.5, 1.5) for _ in range(turns)] for _ in range(n)]


def summarize(ms: list[float]) -> dict[str, float]:
    """Mean, p50 and p90 of `ms` (disagg bench's Distribution: numpy's linear percentiles; NaN where empty)."""
    d = Distribution.of([m / 1e3 for m in ms])
    return {"mean": d.mean, "p50": d.p50, "p90": d.p90}


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft_ms: float
    answer: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Result:
    config: str
    wall_s: float
    turns: list[Turn] = field(default_factory=list)
    tier_hit_tokens: dict[str, float] = field(default_factory=dict)

    def stats(self) -> dict:
        later = [t.ttft_ms for t in self.turns if t.turn > 0]
        return {"ttft_ms": summarize([t.ttft_ms for t in self.turns]), "ttft_later_ms": summarize(later),
                "output_tok_s": sum(t.completion_tokens for t in self.turns) / self.wall_s,
                "cached_tokens": sum(t.cached_tokens for t in self.turns),
                "prompt_tokens": sum(t.prompt_tokens for t in self.turns),
                "tier_hit_tokens": self.tier_hit_tokens}

    def answers(self) -> dict[tuple[int, int], tuple[str, int]]:
        return {(t.conversation, t.turn): (t.answer, t.completion_tokens) for t in self.turns}


def working_set_blocks(turns: list[Turn], block_size: int = BLOCK_SIZE) -> int:
    """Every conversation's last prompt and answer, in KV blocks: what a cache must hold to serve every next turn."""
    last: dict[int, Turn] = {}
    for t in turns:
        if t.conversation not in last or t.turn > last[t.conversation].turn:
            last[t.conversation] = t
    return sum(-(-(t.prompt_tokens + t.completion_tokens) // block_size) for t in last.values())


def chat(port: int, model: str, messages: list[dict], max_tokens: int, ignore_eos: bool = False) \
        -> tuple[float, str, dict]:
    """One streamed, greedy chat completion: (TTFT ms, the answer, the usage)."""
    streamed = stream_chat(port, model, messages, max_tokens, timeout_s=300, ignore_eos=ignore_eos)
    return streamed.ttft_s * 1000, streamed.text, streamed.usage


def drive(port: int, chats: list[Conversation], pauses: list[list[float]], max_tokens: int,
          ignore_eos: bool = False) -> tuple[list[Turn], float]:
    """Every conversation at once, a thread each, its turns in order: every turn and the wall time."""
    model = model_id(f"http://127.0.0.1:{port}")
    turns: list[Turn] = []

    def converse(i: int) -> None:
        answers: list[str] = []
        for t in range(len(chats[i].questions)):
            ttft, answer, usage = chat(port, model, chats[i].messages(t, answers), max_tokens, ignore_eos)
            answers.append(answer)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            turns.append(Turn(i, t, ttft, answer, usage.get("prompt_tokens", 0),
                              usage.get("completion_tokens", 0), cached))
            if t + 1 < len(chats[i].questions):
                time.sleep(pauses[i][t])

    elapsed = timed_in_threads([functools.partial(converse, i) for i in range(len(chats))])
    return sorted(turns, key=lambda t: (t.conversation, t.turn)), elapsed


def tier_hits(metrics_base: int, workers: tuple[str, ...] = ("prefill-0", "decode-0")) -> dict[str, float]:
    """Each worker's disagg_kv_tier_hit_tokens_total (every tier), from its /metrics (up's metrics ports: the router's
    first, then the workers')."""
    ports = metrics_ports(["router", *workers], metrics_base)
    hits = {}
    for name in workers:
        found = scrape_url(f"http://127.0.0.1:{ports[name]}/metrics")
        hits[name] = sum(v for k, v in found.items() if k.startswith("disagg_kv_tier_hit_tokens_total"))
    return hits


def up_command(name: str, args: argparse.Namespace, scratch: Path) -> list[str]:
    """`disagg up` for configuration `name`: the bench's flags, then --up-args, then the configuration's tiers."""
    flags = [f.format(dir=scratch, host_gb=f"{args.host_kv_cache_gb:g}") for f in CONFIGS[name]]
    return [sys.executable, "-m", "services", "up", "--http-port", str(args.port), "--router-port", "0",
            "--metrics-port-base", str(args.metrics_port_base), "--num-kv-blocks", str(args.num_kv_blocks),
            "--dtype", args.dtype, *shlex.split(args.up_args), *flags]


def run_config(name: str, args: argparse.Namespace, chats: list[Conversation], pauses: list[list[float]],
               scratch: Path) -> Result:
    server = Server(name, up_command(name, args, scratch), {}, args.port)
    server.start(scratch, timeout_s=args.start_timeout)
    try:
        chat(args.port, model_id(server.url), [{"role": "user", "content": "Warm up: say hello."}], 4)
        turns, wall = drive(args.port, chats, pauses, args.max_tokens, args.ignore_eos)
        return Result(name, wall, turns, tier_hits(args.metrics_port_base, args.workers))
    finally:
        server.stop()


def report(results: list[Result], pool_blocks: int) -> str:
    base = results[0]
    lines = ["| config | TTFT mean / p50 / p90 ms | turns 2+: TTFT mean / p50 / p90 ms | out tok/s | cached prompt "
             "tokens | tier hit tokens (prefill, decode) | vs none: TTFT mean, turns 2+, tok/s | same answers |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    b = base.stats()
    for result in results:
        s = result.stats()
        same = result.answers() == base.answers()
        ratio = (f"{b['ttft_ms']['mean'] / s['ttft_ms']['mean']:.2f}x, "
                 f"{b['ttft_later_ms']['mean'] / s['ttft_later_ms']['mean']:.2f}x, "
                 f"{s['output_tok_s'] / b['output_tok_s']:.2f}x")
        hits = ", ".join(f"{v:.0f}" for v in s["tier_hit_tokens"].values())
        lines.append(f"| {result.config} | {_ms(s['ttft_ms'])} | {_ms(s['ttft_later_ms'])} | "
                     f"{s['output_tok_s']:.1f} | {s['cached_tokens']} of {s['prompt_tokens']} | {hits} | {ratio} | "
                     f"{'yes' if same else 'NO'} |")
    empty = sum(not t.answer for t in base.turns)
    if empty:
        lines.append(f"\n{empty} of {len(base.turns)} answers of `none` are empty: for them only the token count is "
                     "compared (random weights: --ignore-eos)")
    blocks = working_set_blocks(base.turns)
    lines.append(f"\nworking set {blocks} blocks of {BLOCK_SIZE} tokens = {blocks / pool_blocks:.1f}x the device pool "
                 f"of {pool_blocks} blocks")
    return "\n".join(lines)


def _ms(s: dict[str, float]) -> str:
    return f"{s['mean']:.0f} / {s['p50']:.0f} / {s['p90']:.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--think-s", type=float, default=0.5)
    parser.add_argument("--num-kv-blocks", type=int, default=64)
    parser.add_argument("--configs", default="none,disk,shared")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--host-kv-cache-gb", type=float, default=2.0, help="each worker's host tier (configs host, "
                        "host+disk)")
    parser.add_argument("--up-args", default="", help="more `disagg up` flags (a GPU: --device cuda --model DIR "
                        "--load-format dummy)")
    parser.add_argument("--ignore-eos", action="store_true", help="every answer --max-tokens long (random weights)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--port", type=int, default=18471)
    parser.add_argument("--metrics-port-base", type=int, default=18480)
    parser.add_argument("--workers", type=lambda text: tuple(text.split(",")), default=("prefill-0", "decode-0"),
                        help="the workers whose /metrics count tier hits, in up's order (--prefill 0: decode-0)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    names = args.configs.split(",")
    if names[0] != "none" or set(names) - set(CONFIGS):
        parser.error(f"--configs: a list of {list(CONFIGS)}, none first (the others are compared with it)")
    stop_on_sigterm()
    chats = conversations(args.conversations, args.turns)
    pauses = think_times(args.conversations, args.turns, args.think_s)
    results = []
    with tempfile.TemporaryDirectory(prefix="multi-turn-") as scratch:
        for name in names:
            results.append(run_config(name, args, chats, pauses, Path(scratch)))
            print(f"{name}: {len(results[-1].turns)} turns in {results[-1].wall_s:.1f} s", flush=True)
    print(report(results, args.num_kv_blocks))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": {r.config: {**r.stats(), "wall_s": r.wall_s} for r in results}},
                                        indent=1))
    return 0 if all(r.answers() == results[0].answers() for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

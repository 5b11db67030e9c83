"""Speculative decoding against none, on `disagg up` with its defaults, one after the other, the same requests.

    python -m benchmarks.spec_decode [--configs off,ngram] [--workloads rewrite,chat] [--concurrency 1,8]
        [--requests 8] [--max-tokens 160] [--up-args "--device cuda --model DIR"] [--json out.json]

Two workloads of chat completions (streaming, greedy, the model's own end of text or --max-tokens):
- `rewrite`: "rewrite this text with one word changed" over a paragraph the prompt holds, so the answer repeats
  most of the prompt: where prompt lookup (n-gram) drafts pay;
- `chat`: open questions whose answers repeat nothing of the prompt: where drafts fail, and speculation must
  cost nothing (its acceptance turns it off).
Each --configs entry is one `disagg up` (default model, SmolLM2-135M-Instruct, unless --up-args name another):
`off`, or `ngram` (--speculative-config NGRAM). Each workload runs at each --concurrency with --requests requests
a concurrency slot (different paragraphs and questions, the same for every config). Printed per workload and
concurrency: output tok/s, TTFT mean, TPOT mean (the time between a request's first and last token over its tokens
after the first: its inter-token latency, however many tokens a chunk carries) and the chunk gap p99, each config
against `off` (TPOT: off / it, >= 1 is faster), the decode workers' acceptance (accepted over drafted tokens, and
the mean tokens a verify emits) from their /metrics, and whether every answer equals `off`'s (greedy: it must,
up to near-ties of the arithmetic).

    python -m benchmarks.spec_decode --draft-costs TARGET_DIR,DRAFT_DIR [--k 4] [--device cuda] [--dummy]

runs no server: the engine's own step-cost measurement (common.engine.spec.costs, as a worker runs it at start) for
the target with that draft model (or EAGLE-3 head, where its config.json names one: method eagle3; `--dummy`: random
weights from the config.json files), and prints per batch size
the plain decode step, the draft's proposal of K tokens for every row, the verify step (the step less the
proposal) and the acceptance rate at which speculation breaks even (below it, no K emits more than one token per
plain step's cost). Random-weight drafts give costs, not acceptance: whether a pair clears that rate takes a
trained pair.
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import tempfile
import threading
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

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
CONFIGS = {"off": [], "ngram": ["--speculative-config", NGRAM]}
SENTENCES = (
    "The harbor was quiet in the early morning, and the fishing boats rocked gently against the old wooden pier.",
    "A small bakery on the corner opened its doors at six, filling the street with the smell of fresh bread.",
    "Children walked to school in pairs, talking about the storm that had knocked down the oak tree by the river.",
    "The mayor promised that the library would stay open late on weekdays so that students could study there.",
    "In the afternoon the wind turned cold, and the market traders packed their fruit into crates before the rain.",
    "Her grandfather kept a notebook of every bird he saw, with the date, the weather and a short drawing.",
    "The train to the city left every hour, and most people on it read the newspaper or slept until the tunnel.",
    "When the lights went out, the whole village gathered in the hall to share candles, soup and old stories.",
)
QUESTIONS = ("Why do cats purr?", "What makes a good breakfast?", "How do airplanes stay in the air?",
             "What is the best way to learn a new language?", "Why is the sky blue?",
             "What should I pack for a hiking trip?", "How does a refrigerator keep food cold?",
             "What are some tips for sleeping better?", "Why do leaves change color in autumn?",
             "How can I start saving money?", "What is the difference between weather and climate?",
             "How do bees make honey?")
SWAPS = (("quiet", "calm"), ("small", "tiny"), ("cold", "chilly"), ("old", "ancient"), ("every", "each"))


def rewrite_prompt(i: int) -> str:
    rng = random.Random(i)
    paragraph = " ".join(rng.sample(SENTENCES, 4))
    old, new = SWAPS[i % len(SWAPS)]
    return (f"Rewrite the following text exactly as it is, but replace the word \"{old}\" with \"{new}\":\n\n"
            f"{paragraph}")


def chat_prompt(i: int) -> str:
    return f"{QUESTIONS[i % len(QUESTIONS)]} Answer in a few sentences."


WORKLOADS = {"rewrite": rewrite_prompt, "chat": chat_prompt}


@dataclass
class Answer:
    ttft_s: float
    tpot_s: float | None
    gaps_s: list[float]
    tokens: int
    text: str


@dataclass
class Run:
    config: str
    workload: str
    concurrency: int
    wall_s: float
    answers: list[Answer] = field(default_factory=list)
    acceptance: dict[str, float] = field(default_factory=dict)

    def stats(self) -> dict:
        tpots = [a.tpot_s for a in self.answers if a.tpot_s is not None]
        gaps = [g for a in self.answers for g in a.gaps_s]
        return {"output_tok_s": sum(a.tokens for a in self.answers) / self.wall_s,
                "ttft_ms": 1e3 * statistics.fmean(a.ttft_s for a in self.answers),
                "tpot_ms": 1e3 * statistics.fmean(tpots) if tpots else float("nan"),
                "gap_p99_ms": Distribution.of(gaps).p99 if gaps else float("nan"),  # (ms)
                "tokens": sum(a.tokens for a in self.answers), **self.acceptance}


def ask(port: int, model: str, prompt: str, max_tokens: int) -> Answer:
    """One streamed greedy chat completion, each content chunk's arrival timed."""
    streamed = stream_chat(port, model, [{"role": "user", "content": prompt}], max_tokens)
    arrivals, tokens = streamed.arrivals, streamed.usage.get("completion_tokens", 0)
    tpot = (arrivals[-1] - arrivals[0]) / (tokens - 1) if arrivals and tokens > 1 else None
    return Answer(streamed.ttft_s, tpot, [b - a for a, b in zip(arrivals, arrivals[1:])], tokens, streamed.text)


def drive(port: int, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[list[Answer], float]:
    """`prompts` through `concurrency` threads, each taking the next prompt as it finishes one; answers in order."""
    model = model_id(f"http://127.0.0.1:{port}")
    answers: list[Answer | None] = [None] * len(prompts)
    todo = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            answers[i] = ask(port, model, prompts[i], max_tokens)

    return answers, timed_in_threads([worker] * concurrency)


def acceptance(metrics_base: int, workers: tuple[str, ...]) -> dict[str, float]:
    """Drafted and accepted tokens and drafts over the workers' /metrics (up's metrics ports)."""
    ports = metrics_ports(["router", *workers], metrics_base)
    totals = {"draft_tokens": 0.0, "accepted_tokens": 0.0, "drafts": 0.0}
    for name in workers:
        found = scrape_url(f"http://127.0.0.1:{ports[name]}/metrics")
        for key in totals:
            totals[key] += sum(v for k, v in found.items() if k.startswith(f"disagg_spec_decode_{key}_total"))
    return totals


def run_config(name: str, args: argparse.Namespace, scratch: Path) -> list[Run]:
    command = [sys.executable, "-m", "services", "up", "--http-port", str(args.port), "--router-port", "0",
               "--metrics-port-base", str(args.metrics_port_base), *shlex.split(args.up_args), *CONFIGS[name]]
    server = Server(name, command, {}, args.port)
    server.start(scratch, timeout_s=args.start_timeout)
    runs = []
    try:
        ask(args.port, model_id(server.url), "Say hello.", 8)  # (warm: not counted)
        for workload in args.workloads.split(","):
            for concurrency in map(int, args.concurrency.split(",")):
                before = acceptance(args.metrics_port_base, args.workers)
                prompts = [WORKLOADS[workload](i) for i in range(args.requests * concurrency)]
                answers, wall = drive(args.port, prompts, concurrency, args.max_tokens)
                after = acceptance(args.metrics_port_base, args.workers)
                run = Run(name, workload, concurrency, wall, answers,
                          {k: after[k] - before[k] for k in after})
                runs.append(run)
                print(f"{name} {workload} c{concurrency}: {run.stats()}", flush=True)
    finally:
        server.stop()
    return runs


def report(runs: list[Run]) -> str:
    base = {(r.workload, r.concurrency): r for r in runs if r.config == "off"}
    lines = ["| workload | concurrency | config | out tok/s | TTFT mean ms | TPOT mean ms | chunk gap p99 ms | "
             "vs off: tok/s, TPOT | acceptance | tokens a verify | same answers |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        s, ref = run.stats(), base.get((run.workload, run.concurrency))
        b = ref.stats() if ref is not None else s
        vs = f"{s['output_tok_s'] / b['output_tok_s']:.2f}x, {b['tpot_ms'] / s['tpot_ms']:.2f}x"
        drafted = s.get("draft_tokens", 0.0)
        rate = f"{s['accepted_tokens'] / drafted:.2f}" if drafted else "-"
        per_verify = f"{1 + s['accepted_tokens'] / s['drafts']:.2f}" if s.get("drafts") else "-"
        same = "-" if ref is None else ("yes" if [a.text for a in run.answers] == [a.text for a in ref.answers]
                                        else f"{sum(a.text == o.text for a, o in zip(run.answers, ref.answers))} "
                                             f"of {len(run.answers)}")
        lines.append(f"| {run.workload} | {run.concurrency} | {run.config} | {s['output_tok_s']:.1f} | "
                     f"{s['ttft_ms']:.1f} | {s['tpot_ms']:.2f} | {s['gap_p99_ms']:.1f} | {vs} | {rate} | "
                     f"{per_verify} | {same} |")
    return "\n".join(lines)


def break_even_rate(policy) -> float | None:
    """The lowest acceptance rate at which some K pays under `policy` (an AcceptancePolicy), None: none does."""
    return next((i / 1000 for i in range(1001) if policy.best_k(i / 1000) > 0), None)


def draft_costs(target: str, draft: str, k: int, device: str, dummy: bool) -> list[dict]:
    """Per batch size: the plain step, the proposal and the verify step (ms, medians) and the break-even rate."""
    import time

    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.engine.spec.config import parse_speculative_config
    from common.engine.spec.costs import measure_policies

    from common.engine.spec.eagle3_head import ARCHITECTURES

    architectures = json.loads((Path(draft) / "config.json").read_text()).get("architectures") or []
    method = "eagle3" if set(architectures) & set(ARCHITECTURES) else "draft"
    spec = json.dumps({"method": method, "model": draft, "num_speculative_tokens": k})
    engine = LLMEngine(EngineConfig(model=target, device=device, load_format="dummy" if dummy else "auto",
                                    dtype="bfloat16" if device.startswith("cuda") else "float32",
                                    speculative_config=parse_speculative_config(spec)))
    steps: dict[tuple, list[tuple[float, float]]] = {}  # (k, batch) -> each step's (seconds, of them proposing)
    proposing = [0.0]
    step, proposer = engine.step, engine.speculator.proposer
    propose_many = proposer.propose_many

    def timed_step():
        key, proposing[0], start = (engine.speculator.forced_k, engine.num_running), 0.0, time.perf_counter()
        out = step()
        steps.setdefault(key, []).append((time.perf_counter() - start, proposing[0]))
        return out

    def timed_propose(histories, ks, request_ids):
        start = time.perf_counter()
        out = propose_many(histories, ks, request_ids)
        proposing[0] += time.perf_counter() - start
        return out

    engine.step, proposer.propose_many = timed_step, timed_propose
    policies = measure_policies(engine) or {}
    rows = []
    for batch, policy in sorted(policies.items()):
        timed = steps[(k, batch)]
        rows.append({"batch": batch, "plain_ms": 1e3 * statistics.median(t for t, _ in steps[(0, batch)]),
                     "propose_ms": 1e3 * statistics.median(p for _, p in timed),
                     "verify_ms": 1e3 * statistics.median(t - p for t, p in timed), "step_cost": policy.step_cost[k],
                     "break_even": break_even_rate(policy)})
    engine.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="off,ngram", help=f"comma-separated, off first: {list(CONFIGS)}")
    parser.add_argument("--workloads", default="rewrite,chat", help=f"comma-separated: {list(WORKLOADS)}")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests", type=int, default=6, help="requests a concurrency slot")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--up-args", default="", help="more `disagg up` flags (a GPU: --device cuda --model DIR)")
    parser.add_argument("--workers", default="prefill-0,decode-0", help="the workers whose /metrics count drafts")
    parser.add_argument("--port", type=int, default=18571)
    parser.add_argument("--metrics-port-base", type=int, default=18580)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--draft-costs", default=None, metavar="TARGET_DIR,DRAFT_DIR",
                        help="no server: a draft model's (or EAGLE-3 head's) per-step cost and break-even "
                        "acceptance")
    parser.add_argument("--k", type=int, default=4, help="--draft-costs: draft tokens a step")
    parser.add_argument("--device", default="cpu", help="--draft-costs: the engine's device")
    parser.add_argument("--dummy", action="store_true", help="--draft-costs: random weights (--load-format dummy)")
    args = parser.parse_args()
    if args.draft_costs:
        target, draft = args.draft_costs.split(",")
        for row in draft_costs(target, draft, args.k, args.device, args.dummy):
            even = "none pays" if row["break_even"] is None else f"{row['break_even']:.3f}"
            print(f"batch {row['batch']}: plain step {row['plain_ms']:.2f} ms, propose {args.k} "
                  f"{row['propose_ms']:.2f} ms, verify {row['verify_ms']:.2f} ms ({row['step_cost']:.2f}x a plain "
                  f"step in all), break-even acceptance {even}")
        return 0
    args.workers = tuple(args.workers.split(","))
    names = args.configs.split(",")
    if names[0] != "off" or set(names) - set(CONFIGS) or set(args.workloads.split(",")) - set(WORKLOADS):
        parser.error(f"--configs: {list(CONFIGS)}, off first; --workloads: {list(WORKLOADS)}")
    stop_on_sigterm()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="spec-decode-") as scratch:
        for name in names:
            runs += run_config(name, args, Path(scratch))
    print(report(runs))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "runs": [{"config": r.config, "workload": r.workload,
                                                   "concurrency": r.concurrency, **r.stats()} for r in runs]},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

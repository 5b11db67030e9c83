"""How many runs of consecutive block ids a cross-GPU KV pull copies, under a serving churn (no GPU, no model).

    python -m benchmarks.block_runs [--steps 4000] [--seed 0] [--decode-blocks N] [--no-prefix-caching]

A prefill pool and a decode pool (common.engine.block_manager.BlockManager) driven the way 1P1D drives them:
prompts of 20-120 blocks (half of them open with one of 8 shared system prompts) arrive at random, prefill
allocates them in chunks of its token budget and holds each finished prompt's blocks until decode has reserved its
own and pulled; decode grows each request by a block every 16 tokens and frees it at a random end. Each pull's
runs are those peer_copy's copy engines would make (common.kv.blocks.runs of the source and
destination ids: more than MAX_COPY_ENGINE_RUNS and the pull falls back to a kernel). Prints, for plain LRU order
and for the runs BlockManager now makes: the mean and p90 runs per pull, the share of pulls the copy engines take,
the runs of each side alone, decode's pool usage and the prefill pool's prefix-cache hit rate. Then a multi-turn
chat on one pool (--chat-blocks): the prefix cache's hit rate, what runs may cost it.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections import deque
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.block_manager import BlockManager  # noqa: E402
from common.engine.request import Request  # noqa: E402
from common.kv.blocks import runs  # noqa: E402
from common.kv.transports.cuda_ipc.peer_copy import MAX_COPY_ENGINE_RUNS  # noqa: E402

BLOCK = 16


class LruBlockManager(BlockManager):
    """The order before runs: the free queue's head, one block at a time (reserve: its reservable ones)."""

    def _pick(self, needed: int, after: int | None = None, done: int | None = None) -> list[int] | None:
        ok = (b for b in self.free_queue if done is None or self._freed_at[b] <= done)
        picked = list(islice(ok, needed))
        return picked if len(picked) == needed else None


@dataclass
class Churn:
    prefill_blocks: int = 20000
    decode_blocks: int = 20000
    arrivals: float = 0.3  # requests a step
    budget: int = 2048  # prefill tokens a step (chunked prefill)
    output: tuple[int, int] = (32, 256)  # tokens decoded, uniform
    shared: float = 0.5  # share of prompts that open with a shared system prompt
    prefix_caching: bool = True  # benchmarks.multi_gpu runs its workers without (no block is then cached)


def simulate(manager: type[BlockManager], churn: Churn, steps: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30000) for _ in range(BLOCK * rng.randint(2, 8))] for _ in range(8)]
    prefill = manager(churn.prefill_blocks, BLOCK, churn.prefix_caching)
    decode = manager(churn.decode_blocks, BLOCK, churn.prefix_caching)
    waiting: deque[Request] = deque()
    prefilling: list[Request] = []
    done: deque[Request] = deque()  # prompts computed, blocks held until decode pulls them
    decoding: list[list] = []  # [request, tokens left to decode]
    pulls, src_runs, dst_runs, prompt_tokens, used = [], [], [], 0, []
    for step in range(steps):
        used.append(decode.usage)
        for bm in (prefill, decode):
            bm.steps_launched += 1
            bm.steps_done = bm.steps_launched - 1  # one step launched ahead
        if rng.random() < churn.arrivals:
            head = systems[min(int(rng.paretovariate(1.2)) - 1, 7)] if rng.random() < churn.shared else []
            n = BLOCK * rng.randint(20, 120) - rng.randrange(BLOCK) - len(head)
            waiting.append(Request(f"r{step}", head + [rng.randrange(1, 30000) for _ in range(max(n, 1))]))
        budget = churn.budget
        for request in list(prefilling):  # unfinished prompts' next chunks first, then new ones
            budget = _chunk(prefill, request, budget, prefilling, done)
        while waiting and budget > 0:
            request = waiting[0]
            prefill.match_prefix(request)
            if not prefill.allocate_slots(request, min(request.num_tokens - request.num_computed_tokens, budget)):
                prefill.prefix_hit_tokens -= request.num_computed_tokens  # counted again at the next try
                prefill.free(request)
                break
            waiting.popleft()
            prompt_tokens += request.num_tokens
            prefilling.append(request)
            budget = _chunk(prefill, request, budget, prefilling, done, allocated=True)
        while done:
            request = done[0]
            reserved = decode.reserve(-(-(request.num_tokens + 1) // BLOCK))
            if reserved is None:
                break
            done.popleft()
            src = request.block_table
            pulls.append(len(runs(src, reserved[: len(src)])))
            src_runs.append(len(runs(src, src)))
            dst_runs.append(len(runs(reserved, reserved)))
            twin = Request(request.request_id, list(request.all_token_ids))
            twin.block_table, twin.num_computed_tokens = reserved, request.num_tokens
            decode.commit_full_blocks(twin)
            decoding.append([twin, rng.randint(*churn.output)])
            prefill.free(request)
        for row in list(decoding):
            twin = row[0]
            twin.output_token_ids.append(1)
            row[1] -= 1
            if not row[1] or not decode.allocate_slots(twin, 1):  # the pool short: ends it (as a preemption)
                decoding.remove(row)
                decode.free(twin)
                continue
            twin.num_computed_tokens += 1
            decode.commit_full_blocks(twin)
    pulls.sort()
    return {"pulls": len(pulls), "runs_mean": statistics.fmean(pulls), "runs_p90": pulls[int(0.9 * len(pulls))],
            "copy_engine": sum(r <= MAX_COPY_ENGINE_RUNS for r in pulls) / len(pulls),
            "src_runs": statistics.fmean(src_runs), "dst_runs": statistics.fmean(dst_runs),
            "prefix_hit": prefill.prefix_hit_tokens / prompt_tokens, "decode_usage": statistics.fmean(used)}


def chat(manager: type[BlockManager], num_blocks: int, steps: int, seed: int) -> tuple[float, float]:
    """One aggregated pool serving multi-turn chats (300, Zipf-popular; each turn's prompt is the conversation so
    far): (prefix-cache hit rate, mean runs of a prompt's new blocks). What runs may cost the prefix cache."""
    rng = random.Random(seed)
    bm, history = manager(num_blocks, BLOCK), {}
    live: list[list] = []  # [request, tokens left, conversation]
    prompt_tokens, new_runs = 0, []
    for step in range(steps):
        bm.steps_launched += 1
        bm.steps_done = bm.steps_launched - 1
        if rng.random() < 0.3:
            talk = min(int(rng.paretovariate(0.8)), 300)
            past = history.get(talk, [])
            past = past if len(past) < 110 * BLOCK else []
            turn = BLOCK * (rng.randint(2, 10) if past else rng.randint(20, 60))
            request = Request(f"r{step}", past + [rng.randrange(1, 30000) for _ in range(turn)])
            bm.match_prefix(request)
            hit = len(request.block_table)
            if bm.allocate_slots(request, request.num_tokens - request.num_computed_tokens):
                prompt_tokens += request.num_tokens
                new_runs.append(len(runs(request.block_table[hit:], request.block_table[hit:])))
                request.num_computed_tokens = request.num_tokens
                bm.commit_full_blocks(request)
                live.append([request, rng.randint(32, 256), talk])
            else:
                bm.prefix_hit_tokens -= request.num_computed_tokens
                bm.free(request)
        for row in list(live):
            request = row[0]
            request.output_token_ids.append(rng.randrange(1, 30000))
            row[1] -= 1
            if not row[1] or not bm.allocate_slots(request, 1):
                live.remove(row)
                history[row[2]] = list(request.all_token_ids)
                bm.free(request)
                continue
            request.num_computed_tokens += 1
            bm.commit_full_blocks(request)
    return bm.prefix_hit_tokens / prompt_tokens, statistics.fmean(new_runs)


def _chunk(bm: BlockManager, request: Request, budget: int, prefilling: list[Request], done: deque[Request],
           allocated: bool = False) -> int:
    """Compute the request's next chunk within `budget` (allocating its blocks unless done); the budget left."""
    n = min(request.num_tokens - request.num_computed_tokens, budget)
    if n <= 0 or not (allocated or bm.allocate_slots(request, n)):
        return budget
    request.num_computed_tokens += n
    bm.commit_full_blocks(request)
    if request.num_computed_tokens == request.num_tokens:
        prefilling.remove(request)
        done.append(request)
    return budget - n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-blocks", type=int, default=Churn.prefill_blocks)
    parser.add_argument("--decode-blocks", type=int, default=Churn.decode_blocks)
    parser.add_argument("--no-prefix-caching", action="store_true", help="the 1P1D pools' (as multi_gpu's workers)")
    parser.add_argument("--chat-blocks", type=int, nargs="*", default=[6000, 12000],
                        help="pool sizes of the multi-turn chat run (the prefix cache's cost)")
    args = parser.parse_args()
    churn = Churn(prefill_blocks=args.prefill_blocks, decode_blocks=args.decode_blocks,
                  prefix_caching=not args.no_prefix_caching)
    orders = (("lru", LruBlockManager), ("runs", BlockManager))
    print(f"1P1D churn, {args.steps} steps, pools {churn.prefill_blocks} / {churn.decode_blocks} blocks, prefix "
          f"caching {'on' if churn.prefix_caching else 'off'}")
    print(f"{'order':>6} {'pulls':>6} {'runs mean':>9} {'p90':>4} {'copy engines':>12} {'src runs':>8} "
          f"{'dst runs':>8} {'decode used':>11} {'prefix hit':>10}")
    for name, manager in orders:
        r = simulate(manager, churn, args.steps, args.seed)
        print(f"{name:>6} {r['pulls']:>6} {r['runs_mean']:>9.2f} {r['runs_p90']:>4} {r['copy_engine']:>12.0%} "
              f"{r['src_runs']:>8.2f} {r['dst_runs']:>8.2f} {r['decode_usage']:>11.0%} {r['prefix_hit']:>10.1%}")
    for num_blocks in args.chat_blocks:
        print(f"multi-turn chat on one pool of {num_blocks} blocks, {args.steps} steps")
        for name, manager in orders:
            hit, new_runs = chat(manager, num_blocks, args.steps, args.seed)
            print(f"{name:>6} prefix hit {hit:6.1%}, runs of a prompt's new blocks {new_runs:5.2f}")


if __name__ == "__main__":
    main()

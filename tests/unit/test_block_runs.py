"""The block pool hands out runs of consecutive ids (few copies for a cross-GPU pull), LRU's victim first."""
import random
import statistics
from itertools import islice

from common.engine.block_manager import BlockManager
from common.engine.request import Request
from common.kv.blocks import runs

BS = 4


def _request(num_blocks: int, rid: str, first: int = 0) -> Request:
    return Request(rid, list(range(first, first + num_blocks * BS)))


def _allocate(bm: BlockManager, request: Request, cache: bool = False) -> list[int]:
    before = len(request.block_table)
    assert bm.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = request.num_tokens
    if cache:
        bm.commit_full_blocks(request)
    return request.block_table[before:]


def _num_runs(ids: list[int]) -> int:
    return len(runs(ids, ids))


class LruBlockManager(BlockManager):
    """The order before runs: the free queue's head, one block at a time."""

    def _pick(self, needed, after=None, done=None):
        picked = list(islice((b for b in self.free_queue if done is None or self._freed_at[b] <= done), needed))
        return picked if len(picked) == needed else None


def test_a_fresh_pool_hands_out_consecutive_ids():
    bm = BlockManager(32, BS)
    assert _allocate(bm, _request(10, "a")) == list(range(10))
    assert _allocate(bm, _request(5, "b")) == list(range(10, 15))
    assert bm.reserve(6) == list(range(15, 21))


def test_a_freed_session_comes_back_as_one_run_from_its_lru_tail():
    bm = BlockManager(32, BS)
    a, b = _request(10, "a"), _request(10, "b", first=1000)
    _allocate(bm, a, cache=True)
    _allocate(bm, b, cache=True)
    bm.free(a)  # tail first: the queue is 20..31, then 9, 8, ..., 0
    assert _allocate(bm, _request(12, "c", first=2000)) == list(range(20, 32))
    # The LRU head is a's last block (9): taken, and with it a's blocks that LRU would take next, in id order.
    assert next(iter(bm.free_queue)) == 9
    assert _allocate(bm, _request(6, "d", first=3000)) == list(range(4, 10))
    again = _request(10, "again")
    bm.match_prefix(again)
    assert again.block_table == [0, 1, 2, 3]  # a's prefix start is still cached: evicted from its end, as LRU does


def test_the_lru_head_is_always_taken():
    bm = BlockManager(16, BS)
    reqs = [_request(2, f"r{i}", first=100 * i) for i in range(8)]
    for r in reqs:
        _allocate(bm, r)
    for r in (reqs[5], reqs[1], reqs[6]):  # queue: 11, 10, 3, 2, 13, 12
        bm.free(r)
    assert _allocate(bm, _request(1, "one")) == [11]
    assert _allocate(bm, _request(3, "three")) == [10, 2, 3]  # 10's neighbours are taken: the next head, 3, and 2
    assert _allocate(bm, _request(2, "two")) == [12, 13]


def test_a_request_grows_from_its_last_block_where_that_is_free():
    bm = BlockManager(16, BS)
    r, s = _request(2, "r"), _request(4, "s", first=100)
    assert _allocate(bm, r) == [0, 1]
    assert _allocate(bm, s) == [2, 3, 4, 5]
    bm.free(s)
    r.prompt_token_ids.extend(range(50, 50 + 3 * BS))  # a next chunk of 3 blocks
    assert _allocate(bm, r) == [2, 3, 4]  # LRU alone would give 6, 7, 8
    assert _num_runs(r.block_table) == 1


def test_a_recently_freed_cached_prefix_is_not_taken_to_make_a_run():
    bm = BlockManager(16, BS)
    r, s = _request(2, "r"), _request(4, "s", first=100)
    _allocate(bm, r)
    _allocate(bm, s, cache=True)
    bm.free(s)  # s's blocks 2..5 are cached and the most recently freed: LRU keeps them longest
    r.prompt_token_ids.extend(range(50, 50 + 3 * BS))
    assert _allocate(bm, r) == [6, 7, 8]
    late = _request(4, "late", first=100)
    bm.match_prefix(late)
    assert late.block_table == [2, 3, 4]  # (a prompt's last token is always computed)


def test_reserve_skips_blocks_a_step_in_flight_may_write():
    bm = BlockManager(8, BS)
    a = _request(4, "a")
    _allocate(bm, a)
    bm.steps_launched, bm.steps_done = 5, 4  # step 5 may still write a's blocks
    bm.free(a)  # the queue: 4..7, then 3..0
    assert bm.reserve(4) == [4, 5, 6, 7]  # 3 is free and next to 4, but not reservable yet
    assert bm.reserve(1) is None
    bm.steps_done = 5
    assert bm.reserve(4) == [0, 1, 2, 3]


def test_a_taken_cached_block_leaves_the_prefix_cache():
    bm = BlockManager(8, BS)
    a = _request(4, "a")
    _allocate(bm, a, cache=True)
    bm.free(a)
    other = _request(7, "other", first=500)
    assert _allocate(bm, other) == list(range(1, 8))  # what LRU takes (4..7, then a's from its tail), in one run
    assert list(bm.cached.values()) == [0]
    again = _request(4, "again")
    bm.match_prefix(again)
    assert again.block_table == [0]


def _churn(manager: type[BlockManager], seed: int = 0, steps: int = 1500) -> tuple[float, BlockManager]:
    """Prompts of 20-120 blocks arrive at random, grow a block every 4 steps and end at random; the mean runs of a
    prompt's allocation."""
    rng = random.Random(seed)
    bm = manager(3000, BS)
    live: list[list] = []  # [request, blocks left to grow]
    prompt_runs = []
    for step in range(steps):
        bm.steps_launched += 1
        bm.steps_done = bm.steps_launched - 1
        if rng.random() < 0.3:
            request = _request(rng.randint(20, 120), f"r{step}", first=10_000 * step)
            if bm.allocate_slots(request, request.num_tokens):
                request.num_computed_tokens = request.num_tokens
                bm.commit_full_blocks(request)
                prompt_runs.append(_num_runs(request.block_table))
                live.append([request, rng.randint(1, 16)])
        for row in list(live):
            request = row[0]
            if step % 4 == 0:
                request.output_token_ids.extend([7] * BS)
                row[1] -= 1
                if not row[1] or not bm.allocate_slots(request, BS):
                    live.remove(row)
                    bm.free(request)
                    continue
                request.num_computed_tokens = request.num_tokens
                bm.commit_full_blocks(request)
    held = [b for row in live for b in row[0].block_table]
    assert len(set(held)) == len(held) and not set(held) & set(bm.free_queue)
    assert len(held) + bm.num_free_blocks == bm.num_blocks
    return statistics.fmean(prompt_runs), bm


def test_a_churning_pool_still_hands_prompts_few_runs():
    new, _ = _churn(BlockManager)
    old, _ = _churn(LruBlockManager)
    assert new <= 3 < 20 <= old, (new, old)

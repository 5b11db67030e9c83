"""The block pool: reference counts, chained-hash prefix cache, LRU eviction."""
from common.engine.block_manager import BlockManager, hash_blocks
from common.engine.request import Request


def _request(tokens, rid="r"):
    return Request(rid, list(tokens))


def _fill(bm: BlockManager, request: Request) -> None:
    assert bm.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = request.num_tokens
    bm.commit_full_blocks(request)


def test_hashes_are_chained_so_equal_blocks_after_different_prefixes_differ():
    a = hash_blocks([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = hash_blocks([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1]
    assert hash_blocks([1, 2, 3, 4, 9, 9, 9, 9, 7], 4) == a  # partial blocks are never hashed


def test_shared_prefix_is_shared_with_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = _request(range(10))
    _fill(bm, first)
    second = _request(list(range(8)) + [50, 51], "second")
    bm.match_prefix(second)
    assert second.block_table == first.block_table[:2] and second.num_computed_tokens == 8
    assert [bm.blocks[b].ref_count for b in first.block_table[:2]] == [2, 2]
    bm.free(first)
    bm.free(second)
    assert bm.num_free_blocks == 8


def test_freed_blocks_stay_cached_until_evicted():
    bm = BlockManager(num_blocks=4, block_size=4)
    first = _request(range(9))
    _fill(bm, first)
    bm.free(first)
    again = _request(range(9), "again")
    bm.match_prefix(again)
    assert again.num_computed_tokens == 8
    bm.free(again)
    # Use the whole pool for other tokens: the cached blocks are evicted.
    other = _request(range(100, 116), "other")
    _fill(bm, other)
    bm.free(other)
    late = _request(range(9), "late")
    bm.match_prefix(late)
    assert late.num_computed_tokens == 0


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    request = _request(range(12))
    assert not bm.allocate_slots(request, 12)
    assert request.block_table == [] and bm.num_free_blocks == 2


def test_prefix_caching_off_never_shares():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    first = _request(range(10))
    _fill(bm, first)
    second = _request(range(10), "second")
    bm.match_prefix(second)
    assert second.num_computed_tokens == 0 and bm.cached == {}


def test_an_import_leaves_the_running_requests_growth_free():
    """reserve() (an import from another thread) takes no block the running requests will grow into: with 6 of 10
    free and 3 kept for growth, 3 can be reserved and 4 cannot; once the growth is gone, 4 can."""
    bm = BlockManager(num_blocks=10, block_size=4)
    running = _request(range(16))
    _fill(bm, running)
    bm.growth_reserved = 3
    assert bm.reserve(4) is None and bm.num_free_blocks == 6
    taken = bm.reserve(3)
    assert taken is not None and bm.num_free_blocks == 3
    bm.free_block_ids(taken)
    bm.growth_reserved = 0
    assert len(bm.reserve(4)) == 4

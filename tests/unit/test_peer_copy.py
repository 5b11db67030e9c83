"""The runs of consecutive blocks a peer copy makes one 2-D copy each (common.kv.blocks.runs)."""
from common.kv.blocks import runs


def test_runs_join_blocks_that_go_up_together_on_both_sides():
    assert runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]


def test_a_break_on_either_side_starts_a_new_run():
    assert runs([1, 2, 3, 4], [7, 8, 10, 11]) == [(1, 7, 2), (3, 10, 2)]
    assert runs([1, 2, 5, 6], [7, 8, 9, 10]) == [(1, 7, 2), (5, 9, 2)]


def test_no_blocks_no_runs_and_every_block_is_covered_once():
    assert runs([], []) == []
    src, dst = [8, 3, 4, 5, 0, 1], [2, 9, 10, 11, 5, 6]
    covered = [(s + i, d + i) for s, d, n in runs(src, dst) for i in range(n)]
    assert covered == list(zip(src, dst))

"""`disagg up`'s placement of workers on GPUs, with the GPUs passed in (no GPU needed): in order, prefill first, a
worker's tensor-parallel ranks on consecutive GPUs, more ranks than GPUs one line unless shared, and then each
worker's share of --gpu-memory-utilization."""
from __future__ import annotations

import pytest

from services.cli.placement import (PlacementError, WorkerPlacement, check_gpus, default_counts, memory_share,
                                    parse_gpus, place, shares_gpus)

TP1 = {"prefill": 1, "decode": 1}


def _layout(workers: list[WorkerPlacement]) -> dict[str, tuple[int, ...]]:
    return {w.name: w.devices for w in workers}


def test_one_prefill_and_three_decode_take_four_gpus_in_order():
    workers = place({"prefill": 1, "decode": 3}, TP1, (0, 1, 2, 3))
    assert _layout(workers) == {"prefill-0": (0,), "decode-0": (1,), "decode-1": (2,), "decode-2": (3,)}
    assert [w.device for w in workers] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [w.role for w in workers] == ["prefill", "decode", "decode", "decode"]
    assert not shares_gpus(workers)


def test_a_tensor_parallel_prefill_takes_consecutive_gpus_and_its_first_is_the_base_device():
    workers = place({"prefill": 1, "decode": 2}, {"prefill": 2, "decode": 1}, (0, 1, 2, 3))
    assert _layout(workers) == {"prefill-0": (0, 1), "decode-0": (2,), "decode-1": (3,)}
    assert workers[0].device == "cuda:0" and workers[0].gpus_text() == "cuda:0,1 (TP 2)"


def test_gpus_are_taken_in_the_order_given():
    workers = place({"prefill": 1, "decode": 1}, TP1, (2, 3))
    assert _layout(workers) == {"prefill-0": (2,), "decode-0": (3,)}


def test_more_ranks_than_gpus_is_one_line_naming_the_counts_and_how_to_share():
    with pytest.raises(PlacementError) as caught:
        place({"prefill": 1, "decode": 3}, {"prefill": 2, "decode": 1}, (0, 1, 2, 3))
    message = str(caught.value)
    assert message == ("1 prefill worker of TP 2 and 3 decode workers need 5 GPUs, one a rank; --gpus gives 4 "
                       "(0,1,2,3). Add --share-gpus to put several workers on a GPU (each gets its share of "
                       "--gpu-memory-utilization), or ask for fewer")
    assert "\n" not in message


def test_shared_gpus_go_round_robin_and_split_the_memory_by_the_workers_on_each():
    workers = place({"prefill": 1, "decode": 3}, TP1, (0, 1), share=True)
    assert _layout(workers) == {"prefill-0": (0,), "decode-0": (1,), "decode-1": (0,), "decode-2": (1,)}
    assert [w.workers_on_gpu for w in workers] == [2, 2, 2, 2] and shares_gpus(workers)
    assert memory_share(0.9, workers[0]) == 0.45
    one_gpu = place({"prefill": 1, "decode": 2}, TP1, (0,), share=True)
    assert [memory_share(0.9, w) for w in one_gpu] == [0.3, 0.3, 0.3]
    assert sum(memory_share(0.95, w) for w in one_gpu) <= 0.95  # rounded down: never more than the user's
    assert memory_share(None, one_gpu[0]) is None  # no fraction given: --num-kv-blocks sizes each cache


def test_sharing_what_fits_changes_nothing():
    assert place({"prefill": 1, "decode": 1}, TP1, (0, 1), share=True) == place({"prefill": 1, "decode": 1}, TP1,
                                                                                (0, 1))
    assert memory_share(0.9, place({"prefill": 0, "decode": 1}, TP1, (0,))[0]) == 0.9


def test_a_tensor_parallel_worker_wider_than_the_gpus_is_refused_even_when_sharing():
    with pytest.raises(PlacementError, match="a decode worker of tensor-parallel size 4 needs 4 GPUs, one a rank; "
                                             r"--gpus gives 2 \(0,1\)"):
        place({"prefill": 0, "decode": 1}, {"prefill": 1, "decode": 4}, (0, 1), share=True)


def test_tensor_parallel_ranks_need_consecutive_gpus():
    with pytest.raises(PlacementError, match="prefill-0's 2 tensor-parallel ranks run on consecutive GPUs"):
        place({"prefill": 1, "decode": 1}, {"prefill": 2, "decode": 1}, (0, 2, 3))
    shared = place({"prefill": 1, "decode": 1}, {"prefill": 2, "decode": 2}, (0, 1, 2), share=True)
    assert _layout(shared) == {"prefill-0": (0, 1), "decode-0": (0, 1)}  # wraps to the start rather than split


def test_the_default_layout_gives_half_the_gpus_to_prefill_and_the_rest_to_decode():
    assert default_counts(1, TP1) == {"prefill": 1, "decode": 1}  # and they share the GPU
    assert default_counts(2, TP1) == {"prefill": 1, "decode": 1}
    assert default_counts(3, TP1) == {"prefill": 1, "decode": 2}
    assert default_counts(4, TP1) == {"prefill": 2, "decode": 2}
    assert default_counts(8, TP1) == {"prefill": 4, "decode": 4}
    assert default_counts(4, {"prefill": 2, "decode": 1}) == {"prefill": 1, "decode": 2}
    assert default_counts(8, {"prefill": 2, "decode": 2}) == {"prefill": 2, "decode": 2}


def test_off_cuda_workers_have_no_gpus_and_keep_the_users_device():
    workers = place({"prefill": 0, "decode": 2}, TP1, None)
    assert [(w.name, w.devices, w.device) for w in workers] == [("decode-0", (), None), ("decode-1", (), None)]


@pytest.mark.parametrize("text", ["", "0,0", "-1", "a,b"])
def test_gpus_flag_takes_distinct_indices(text):
    with pytest.raises(ValueError, match="--gpus takes"):
        parse_gpus(text)


def test_gpus_must_be_visible():
    assert parse_gpus("0, 1,3") == (0, 1, 3)
    check_gpus((0, 1), 2)
    with pytest.raises(PlacementError, match=r"--gpus names cuda:3, but this process sees 2 GPUs \(cuda:0..1"):
        check_gpus((0, 3), 2)
    with pytest.raises(PlacementError, match="no CUDA GPU is visible"):
        check_gpus((0,), 0)

"""The shared-memory collectives of the tensor-parallel ranks (common/engine/shm_collectives.py), with ranks as
threads over one region: sums and gathers are right and bit-identical on every rank, and a rank that runs ahead
(the double-buffered slots) never overwrites what a slower one is still reading."""
from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from common.engine import shm_collectives
from common.engine.shm_collectives import SLOT_BYTES, ShmCollectives

pytestmark = pytest.mark.skipif(not shm_collectives.supported(), reason="x86-64 store order only")


def _ranks(size: int, work) -> list:
    """Run work(collectives, rank) on `size` threads sharing one region; their results by rank."""
    path = shm_collectives.create(size)
    try:
        members = [ShmCollectives(path, rank, size) for rank in range(size)]
    finally:
        os.unlink(path)
    results: list = [None] * size

    def run(rank: int) -> None:
        results[rank] = work(members[rank], rank)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return results


def test_all_reduce_sums_in_rank_order_and_every_rank_holds_the_same_bits():
    inputs = [torch.randn(7, 33, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    results = _ranks(3, lambda c, rank: c.all_reduce(inputs[rank].clone()))
    expected = inputs[0] + inputs[1] + inputs[2]
    for got in results:
        assert torch.equal(got, expected)


def test_all_gather_concatenates_every_rank_along_the_last_dimension():
    inputs = [torch.full((2, 3), float(r), dtype=torch.bfloat16) for r in range(4)]
    results = _ranks(4, lambda c, rank: c.all_gather(inputs[rank]))
    for got in results:
        assert torch.equal(got, torch.cat(inputs, dim=-1))


def test_a_rank_running_ahead_never_overwrites_a_collective_another_is_reading():
    rounds = 300

    def work(c: ShmCollectives, rank: int) -> list[float]:
        rng, sums = random.Random(rank), []
        for k in range(rounds):
            if rng.random() < 0.1:
                time.sleep(0.001)  # a slow rank: the others run a collective ahead
            sums.append(float(c.all_reduce(torch.full((64,), float(k * 10 + rank)))[0]))
        return sums

    results = _ranks(3, work)
    expected = [float(sum(k * 10 + r for r in range(3))) for k in range(rounds)]
    assert all(sums == expected for sums in results)


def test_a_tensor_larger_than_a_slot_is_left_to_gloo():
    c = _ranks(1, lambda c, rank: c)[0]
    assert c.fits(torch.empty(SLOT_BYTES // 4)) and not c.fits(torch.empty(SLOT_BYTES // 4 + 1))

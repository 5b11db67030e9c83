"""A lower tier's hit is taken only where onboarding it costs less than computing its tokens (OnboardPayoff): the
CPU's case, where recompute is dear, keeps every hit; where recompute is cheaper the engine computes the same tokens
instead; a skipped tier is probed again as its evidence ages, and admission holds a request for its prefetch no
longer than computing its blocks would take. Costs are injected through the figures the engine measures (its
prefill seconds a token, a tier's onboard seconds a block), so nothing here depends on this machine's speed."""
from __future__ import annotations

import threading

import pytest

from common.kv.tiers.payoff import OnboardPayoff, PayoffPolicy
from tests.unit.test_kv_tiers_engine import GREEDY, _chat, _disk, _engine, _prompts, _total, baseline  # noqa: F401

SAVED = 6 * 9 * 4  # every full block of every prompt but its last token's (test_kv_tiers_engine's chat)


def test_nothing_measured_takes_every_hit():
    payoff = OnboardPayoff(block_size=4)
    assert payoff.take(["disk"] * 5) == 5
    assert payoff.wait_bound_s(5, default_s=10.0) == 10.0


def test_a_tier_dearer_than_compute_is_skipped_and_a_cheaper_one_taken():
    payoff = OnboardPayoff(block_size=4)
    payoff.prefill(tokens=100, seconds=0.1)  # 1 ms a token: 4 ms a block
    payoff.onboarded("host", blocks=100, seconds=0.1)  # 1 ms a block
    payoff.onboarded("disk", blocks=100, seconds=1.0)  # 10 ms a block
    assert payoff.take(["host"] * 3) == 3
    assert payoff.take(["disk"] * 3) == 0
    assert payoff.take(["host", "host", "disk", "disk"]) == 2  # the host's run, not the disk's after it
    assert payoff.take(["host"] * 8 + ["disk"]) == 8
    assert payoff.wait_bound_s(3, default_s=10.0) == pytest.approx(3 * 0.004)


def test_a_skipped_tier_is_probed_again_and_stopped_again_while_still_dear():
    payoff = OnboardPayoff(block_size=4, policy=PayoffPolicy(half_life_blocks=64, idle_half_life_blocks=512))
    payoff.prefill(tokens=100, seconds=0.1)
    payoff.onboarded("disk", blocks=64, seconds=64 * 0.008)  # twice what computing a block takes
    requests = 0
    while not payoff.take(["disk"] * 16):
        requests += 1
        assert requests < 1000, "a skipped tier is never probed again"
    assert requests > 10  # not at once: its evidence had to age
    payoff.onboarded("disk", blocks=16, seconds=16 * 0.008)  # the probe: still dear
    assert payoff.take(["disk"] * 16) == 0


def test_a_tier_that_became_cheap_is_used_again():
    payoff = OnboardPayoff(block_size=4)
    payoff.prefill(tokens=100, seconds=0.1)
    payoff.onboarded("disk", blocks=64, seconds=64 * 0.008)
    assert payoff.take(["disk"] * 16) == 0
    payoff.prefill(tokens=100, seconds=10.0)  # a longer context, a bigger model: computing got dear
    payoff.prefill(tokens=100, seconds=10.0)
    assert payoff.take(["disk"] * 16) == 16


def test_recompute_dearer_than_the_disk_keeps_every_hit(tiny_llama, baseline, tmp_path):
    """The CPU's case: prefill costs far more than reading a block back, so the second turns take every hit."""
    engine = _engine(tiny_llama, **_disk(tmp_path))
    engine.kv_tiers.payoff.prefill(tokens=1, seconds=1.0)  # a second a token
    assert _chat(engine) == baseline
    assert _total(engine, "disagg_kv_tier_hit_tokens_total", tier="disk") == SAVED
    assert engine.kv_tiers.payoff.onboard_s_per_block("disk") < engine.kv_tiers.payoff.compute_s_per_block
    engine.close()


def test_recompute_cheaper_than_the_disk_computes_the_same_tokens(tiny_llama, baseline, tmp_path):
    engine = _engine(tiny_llama, **_disk(tmp_path))
    payoff = engine.kv_tiers.payoff
    payoff.prefill(tokens=1000, seconds=0.001)  # a microsecond a token
    payoff.onboarded("disk", blocks=1000, seconds=1.0)  # a millisecond a block: 250x computing it
    assert _chat(engine) == baseline
    assert _total(engine, "disagg_kv_tier_hit_tokens_total", tier="disk") == 0
    assert _total(engine, "disagg_kv_tier_offload_bytes_total", tier="disk") > 0  # blocks still go down
    assert engine.block_manager.prefix_hit_tokens == 0
    assert not engine.kv_tiers.prefetches.staged and not engine.kv_tiers.prefetches.skipped  # nothing left behind
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()


def test_a_request_is_held_for_its_prefetch_only_as_long_as_computing_its_blocks(tiny_llama, baseline, tmp_path):
    """The wait bound comes from the measured prefill cost, not FETCH_WAIT_S: a prefetch stuck on the disk past it
    leaves its request to compute the blocks, the same tokens."""
    engine = _engine(tiny_llama, **_disk(tmp_path))
    _chat(engine, turns=1)  # every prompt's blocks on disk
    payoff = engine.kv_tiers.payoff
    payoff.prefill(tokens=1000, seconds=0.001)  # cheap to compute, but no disk figure yet: the prior says take it
    disk, release = engine.kv_tiers.disk, threading.Event()
    read = disk.read
    disk.read = lambda h: (threading.current_thread().name == "kv-tiers" and release.wait(30), read(h))[1]
    engine.add_request("stuck", _prompts()[2], GREEDY)
    engine.step()
    held = engine.kv_tiers.prefetches.staged["stuck"]
    assert held.deferred_at is not None and held.bound_s == pytest.approx(9 * payoff.compute_s_per_block)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    release.set()
    assert tokens == baseline[2]
    assert _total(engine, "disagg_kv_tier_hit_blocks_total", tier="disk") == 0
    # the late prefetch cost its wait and then the computing: the disk now looks dearer than computing, so the
    # next request computes at once instead of waiting again
    assert payoff.onboard_s_per_block("disk") > payoff.compute_s_per_block
    assert payoff.take(["disk"] * 9) == 0
    engine.close()


def test_a_cheap_host_tier_is_taken_and_the_dear_disk_after_it_computed(tiny_llama, baseline, tmp_path):
    """Per tier: the host tier's blocks come up, the disk's (its LRU victims) are computed, the same tokens; none
    of the disk's is read at admission either."""
    import torch

    from common.kv.tiers import KvTiers, TierLayout, TierMetrics, weights_identity
    from common.kv.tiers.disk import DiskTier
    from common.kv.tiers.host import HostTier

    engine = _engine(tiny_llama)
    bm, cache = engine.block_manager, engine.runner.kv_cache
    layout = TierLayout.of(engine.kv_layout, weights_identity(tiny_llama))
    metrics, block_bytes = TierMetrics(), cache.view(torch.uint8)[:, :, 0].numel()
    host = HostTier(15 * block_bytes, block_bytes, pin=False)
    bm.tiers = KvTiers(cache, layout, host, DiskTier(tmp_path / "kv", 1 << 24, layout, metrics), metrics,
                       max_prefetch_blocks=24)
    assert _chat(engine, turns=1) == baseline[:6]
    payoff = bm.tiers.payoff
    # Computing dear enough that a prefetch held back by a loaded machine stays within its wait bound (4 s a block):
    # at 4 ms a block a busy moment made the host's prefetch late, so the host too was measured dear and skipped.
    payoff.prefill(tokens=1000, seconds=1000.0)  # a second a token: 4 s a block
    payoff.onboarded("host", blocks=1000, seconds=0.1)  # 0.1 ms a block
    payoff.onboarded("disk", blocks=1000, seconds=100_000.0)  # 100 s a block
    reads = []
    read = bm.tiers.disk.read
    bm.tiers.disk.read = lambda h: (reads.append(h), read(h))[1]
    assert _chat(engine, turns=1, prompts=_prompts()[::-1]) == baseline[:6][::-1]
    assert _total(engine, "disagg_kv_tier_hit_blocks_total", tier="host") > 0
    assert _total(engine, "disagg_kv_tier_hit_blocks_total", tier="disk") == 0 and not reads
    engine.close()


def test_a_run_of_host_blocks_then_disk_blocks_takes_the_hosts_and_never_reads_the_disk(tmp_path):
    """The prefetch asks for the blocks that pay, and admission loads none after them on the engine thread."""
    import torch

    from common.kv.tiers import KvTiers, TierMetrics
    from common.kv.tiers.disk import DiskTier
    from common.kv.tiers.host import HostTier
    from tests.unit.test_kv_tier_store import BLOCK_BYTES, LAYOUT, _block

    cache = torch.zeros((LAYOUT.num_layers, 2, 8, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim))
    metrics = TierMetrics()
    host, disk = HostTier(4 * BLOCK_BYTES, BLOCK_BYTES, pin=False), DiskTier(tmp_path, 1 << 20, LAYOUT, metrics)
    chain, parent = [], 0
    for i in range(4):
        chain.append(_block(i, parent))
        parent = chain[-1].key.hash
    for block in chain[:2]:
        host.put(block)
    for block in chain[2:]:
        disk.write(block)
    tiers = KvTiers(cache, LAYOUT, host, disk, metrics, max_prefetch_blocks=8)
    tiers.payoff.prefill(tokens=1000, seconds=1.0)
    tiers.payoff.onboarded("host", blocks=1000, seconds=0.1)
    tiers.payoff.onboarded("disk", blocks=1000, seconds=1000.0)
    reads = []
    read = disk.read
    disk.read = lambda h: (reads.append(h), read(h))[1]
    keys = [b.key for b in chain]
    try:
        tiers.prefetch("r", keys)
        assert tiers.mover.drain() and tiers.ready("r")
        fetched = tiers.fetch("r", keys, limit=4)
        assert [b.key for b in fetched] == keys[:2] and not reads
        assert all(torch.equal(got.payload, want.payload) for got, want in zip(fetched, chain))
    finally:
        tiers.close()

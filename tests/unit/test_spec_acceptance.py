"""Each request's K: the k that emits most tokens per unit of step cost at its estimated acceptance, 0 where none
pays; a stopped request probes again as its evidence ages."""
from __future__ import annotations

import random

import pytest

from common.engine.spec.acceptance import AcceptancePolicy, AcceptanceTracker, expected_tokens


def test_expected_tokens_counts_the_targets_own_token():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_free_drafts_always_pay_and_compute_bound_ones_never_do():
    free = AcceptancePolicy(step_cost=(1.0,) * 5)
    assert [free.best_k(r) for r in (0.01, 0.5, 0.99)] == [4, 4, 4]
    assert free.best_k(0.0) == 0  # a draft never accepted buys nothing, even for free
    # Each draft costing a whole plain row (a compute-bound CPU step): E(k) <= k + 1, so never.
    bound = AcceptancePolicy.linear(max_k=4, cost_per_draft=1.0)
    assert [bound.best_k(r) for r in (0.1, 0.5, 0.95)] == [0, 0, 0]


def test_one_draft_pays_past_its_extra_cost():
    policy = AcceptancePolicy.linear(max_k=6, cost_per_draft=0.2)
    assert policy.best_k(0.15) == 0  # 1.15 tokens for 1.2
    assert policy.best_k(0.25) >= 1
    ks = [policy.best_k(i / 100) for i in range(101)]
    assert ks == sorted(ks) and ks[-1] == 6  # K grows with the acceptance rate, up to max_k


def test_lookup_agrees_with_the_search_on_its_grid():
    policy = AcceptancePolicy(step_cost=(1.0, 1.05, 1.3, 1.4, 2.0))
    for i in range(1024):
        rate = i / 1023
        assert policy.best_k(rate) == policy._argmax(rate)


@pytest.mark.parametrize("bad", [dict(step_cost=()), dict(step_cost=(1.1, 1.2)), dict(step_cost=(1.0, 0.0)),
                                 dict(step_cost=(1.0,), half_life=0), dict(step_cost=(1.0,), prior_rate=1.5)])
def test_policy_refuses_meaningless_values(bad):
    with pytest.raises(ValueError):
        AcceptancePolicy(**bad)


def test_failing_drafts_shrink_k_to_zero_and_good_ones_restore_it():
    tracker = AcceptanceTracker(AcceptancePolicy.linear(max_k=5, cost_per_draft=0.1))
    start = tracker.next_k()
    assert start >= 1  # the prior speculates
    ks = []
    for _ in range(10):
        k = tracker.next_k()
        ks.append(k)
        tracker.record(k, 0)
    assert ks[-1] == 0 and ks == sorted(ks, reverse=True)  # within a few steps, shrinking on the way
    for _ in range(400):  # idle steps until it probes, then every draft accepted
        k = tracker.next_k()
        tracker.record(k, k)
    assert tracker.next_k() == 5 and tracker.rate > 0.9


def test_a_stopped_request_probes_now_and_then():
    tracker = AcceptanceTracker(AcceptancePolicy.linear(max_k=4, cost_per_draft=0.1))
    probes = []
    for step in range(3000):
        k = tracker.next_k()
        if k:
            probes.append(step)
        tracker.record(k, 0)
    gaps = [b - a for a, b in zip(probes[len(probes) // 2:], probes[len(probes) // 2 + 1:])]
    print(f"probe every {sum(gaps) / len(gaps):.1f} steps once stopped (cost 0.1 a draft)")
    assert gaps and min(gaps) >= 5


def test_record_refuses_more_accepted_than_proposed():
    tracker = AcceptanceTracker(AcceptancePolicy.linear(max_k=2, cost_per_draft=0.1))
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        tracker.record(2, 3)


def _simulate(rate: float, policy: AcceptancePolicy, steps: int, fixed_k: int | None = None) -> float:
    """Tokens per unit of cost for a request whose drafts are accepted one after another with `rate`."""
    rng = random.Random(0)
    tracker = AcceptanceTracker(policy)
    tokens = cost = 0.0
    for _ in range(steps):
        k = tracker.next_k() if fixed_k is None else fixed_k
        accepted = 0
        while accepted < k and rng.random() < rate:
            accepted += 1
        tracker.record(k, accepted)
        tokens += accepted + 1
        cost += policy.step_cost[k]
    return tokens / cost


@pytest.mark.parametrize("rate", [0.05, 0.3, 0.6, 0.9])
def test_tracker_comes_close_to_the_best_fixed_k(rate):
    policy = AcceptancePolicy.linear(max_k=6, cost_per_draft=0.15)
    oracle = max(_simulate(rate, policy, 4000, fixed_k=k) for k in range(policy.max_k + 1))
    achieved = _simulate(rate, policy, 4000)
    print(f"acceptance {rate}: tracker {achieved:.3f} tokens per plain step's cost, best fixed K {oracle:.3f}")
    assert achieved >= 0.95 * oracle
    if rate == 0.05:
        assert achieved >= 0.97  # off: about a plain decode's one token per step

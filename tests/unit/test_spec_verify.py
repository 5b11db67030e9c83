"""Verification: greedy keeps the matching prefix and the target's next token; rejection sampling emits tokens
distributed as the target's own samples (chi-square on a 6-token vocabulary), for one-hot and for sampled drafts."""
from __future__ import annotations

import pytest
import torch

from common.engine.spec.verify import greedy_accept, greedy_verify, rejection_sample

VOCAB = 6
TRIALS = 200_000
# Chi-square critical value for df = VOCAB - 1 = 5 at alpha = 0.001 (scipy.stats.chi2.ppf(0.999, 5)).
CHI2_CRITICAL_DF5_ALPHA_0_001 = 20.515


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=VOCAB).double()
    expected = probs.double() / probs.sum() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def test_greedy_accept_keeps_the_matching_prefix_and_the_targets_next_token():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted: the bonus too
    assert greedy_accept([5, 6, 7, 8], [1, 6, 7]) == [5]
    assert greedy_accept([5], []) == [5]


def test_greedy_verify_batches_rows_with_fewer_drafts():
    argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]])
    drafts = torch.tensor([[5, 6, 9], [5, 6, 7], [1, 2, -1], [-1, -1, -1]])
    tokens, emitted = greedy_verify(argmax, drafts, torch.tensor([3, 3, 2, 0]))
    assert emitted.tolist() == [3, 4, 3, 1]
    assert tokens.tolist() == [[5, 6, 7, -1], [5, 6, 7, 8], [1, 2, 3, -1], [9, -1, -1, -1]]
    for row in range(4):
        n = int(emitted[row])
        real = drafts[row][drafts[row] >= 0].tolist()
        assert tokens[row, :n].tolist() == greedy_accept(argmax[row].tolist(), real)


def _target(k: int, seed: int) -> torch.Tensor:
    """Random unnormalised weights [K+1, V] (the sampler's kept probabilities do not sum to 1)."""
    return -torch.rand(k + 1, VOCAB, generator=torch.Generator().manual_seed(seed)).log() * 3.0


@pytest.mark.parametrize("sampled_drafts", [False, True], ids=["one_hot", "random_q"])
def test_rejection_sampling_emits_the_targets_distribution(sampled_drafts):
    torch.manual_seed(1)
    k = 3
    p = _target(k, seed=2)
    if sampled_drafts:
        q = torch.distributions.Dirichlet(torch.full((VOCAB,), 0.7)).sample((k,))
        drafts = torch.multinomial(q, TRIALS, replacement=True).T  # [TRIALS, K], each position drawn from its q
        draft_probs = q.expand(TRIALS, k, VOCAB)
    else:  # an n-gram's drafts: the same tokens every trial (random ones would hide a correction drawn from p)
        drafts = p[:k].argmax(dim=-1).expand(TRIALS, k)
        draft_probs = None
    tokens, emitted = rejection_sample(p.expand(TRIALS, k + 1, VOCAB), drafts, torch.full((TRIALS,), k),
                                       torch.Generator().manual_seed(3), draft_probs)
    critical = _critical()
    first = _chi2(tokens[:, 0], p[0])
    print(f"chi2 first token ({'random q' if sampled_drafts else 'one-hot'}): {first:.2f} < {critical:.3f}")
    assert first < critical
    # Given the first draft was accepted, the second emitted token is the target's at position 1.
    second = tokens[emitted >= 2, 1]
    assert second.numel() > TRIALS // 10 and _chi2(second, p[1]) < critical
    assert bool((emitted >= 1).all()) and bool((emitted <= k + 1).all())


def _critical() -> float:
    try:
        from scipy.stats import chi2
    except ImportError:
        return CHI2_CRITICAL_DF5_ALPHA_0_001
    return float(chi2.ppf(0.999, VOCAB - 1))


def test_one_hot_acceptance_rate_is_the_targets_probability_of_the_draft():
    p = torch.tensor([0.1, 0.6, 0.3, 0.0, 0.0, 0.0])
    rows = 100_000
    _, emitted = rejection_sample(p.expand(rows, 2, VOCAB), torch.full((rows, 1), 1),
                                  torch.ones(rows, dtype=torch.long), torch.Generator().manual_seed(0))
    rate = float((emitted == 2).double().mean())
    assert abs(rate - 0.6) < 0.01


def test_drafts_equal_to_the_target_are_all_accepted_then_a_bonus():
    q = torch.distributions.Dirichlet(torch.ones(VOCAB)).sample((4,))
    drafts = torch.multinomial(q[:3], 1).T.expand(50, 3)
    tokens, emitted = rejection_sample(q.expand(50, 4, VOCAB), drafts, torch.full((50,), 3),
                                       torch.Generator().manual_seed(0), q[:3].expand(50, 3, VOCAB))
    assert emitted.tolist() == [4] * 50 and bool((tokens[:, :3] == drafts).all())


def test_a_draft_the_target_excludes_is_rejected_and_not_resampled():
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0]] * 3)
    tokens, emitted = rejection_sample(p.expand(1000, 3, VOCAB), torch.zeros(1000, 2, dtype=torch.long),
                                       torch.full((1000,), 2), torch.Generator().manual_seed(0))
    assert emitted.tolist() == [1] * 1000 and set(tokens[:, 0].tolist()) == {1, 2}
    assert bool((tokens[:, 1:] == -1).all())


def test_rows_with_fewer_drafts_take_their_bonus_where_their_drafts_end():
    p = torch.zeros(2, 4, VOCAB)
    p[:, :, 5] = 1.0  # the target is sure of token 5 everywhere
    p[0, 1] = torch.nn.functional.one_hot(torch.tensor(2), VOCAB).float()  # row 0's bonus position
    drafts = torch.tensor([[5, -1, -1], [5, 5, 5]])
    tokens, emitted = rejection_sample(p, drafts, torch.tensor([1, 3]), torch.Generator().manual_seed(0))
    assert emitted.tolist() == [2, 4]
    assert tokens.tolist() == [[5, 2, -1, -1], [5, 5, 5, 5]]


def test_a_seeded_row_draws_alike_in_any_batch():
    torch.manual_seed(4)
    k, rows = 4, 8
    p = torch.rand(rows, k + 1, VOCAB)
    drafts = torch.randint(0, VOCAB, (rows, k))
    num = torch.full((rows,), k)

    def seeded(row: int) -> torch.Generator:
        return torch.Generator().manual_seed(100 + row)

    together, emitted = rejection_sample(p, drafts, num, [seeded(r) for r in range(rows)])
    for row in (0, 5):
        alone, alone_emitted = rejection_sample(p[row: row + 1], drafts[row: row + 1], num[row: row + 1],
                                                [seeded(row)])
        assert alone.tolist() == together[row: row + 1].tolist() and alone_emitted.tolist() == [int(emitted[row])]
    with pytest.raises(ValueError, match="3 generators for 8 rows"):
        rejection_sample(p, drafts, num, [seeded(r) for r in range(3)])

"""Verification: which of a row's K drafts the target accepts, from its one forward over the K+1 positions.

Rows are batched with their drafts padded to the batch's K (`num_drafts` says how many of each row are real).
Both functions return (tokens [B, K+1], num_emitted [B]): each row's first num_emitted tokens are what it emits
this step, its accepted drafts then one token of the target's (its correction at the first rejection, or the bonus
after all were accepted); the rest are -1.

Sampling is speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft i is accepted with probability
min(1, p_i(d) / q_i(d)); at the first rejection the token is drawn from norm(max(p_i - q_i, 0)); after all are
accepted the bonus is drawn from p_K. Each emitted token is then distributed as the target alone would sample it.
For a draft without a distribution (n-gram: q one-hot on d) that is acceptance with probability p_i(d) and a
correction from p_i without d, and no [B, K, V] q is built.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def greedy_accept(target_argmax: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """One row: the drafts that match the target's argmax, then the target's next token."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_argmax[accepted]:
        accepted += 1
    return list(target_argmax[: accepted + 1])


def greedy_verify(target_argmax: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_argmax [B, K+1] (the target's argmax at each position), draft_tokens [B, K], num_drafts [B]."""
    accepted = _accepted(target_argmax[:, :-1] == draft_tokens, num_drafts)
    return _emitted(target_argmax, accepted), accepted + 1


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                     generator: torch.Generator | Sequence[torch.Generator] | None = None,
                     draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [B, K+1, V] float32: the target's sampling distribution at each position, temperature and
    filters applied (non-negative weights; rows need not sum to 1, as the sampler's kept probabilities do not).
    draft_probs [B, K, V]: the distributions the drafts were drawn from, or None for one-hot drafts.
    generator: one for the batch, or one a row so that a seeded row draws alike in any batch (K+1 uniforms each)."""
    rows, positions, _ = target_probs.shape
    k = positions - 1
    u = _uniforms(rows, positions, generator, target_probs.device)
    mass = target_probs.sum(dim=-1)  # [B, K+1]: normalised where used, never as a [B, K+1, V] copy
    drafts = draft_tokens.clamp(min=0)  # padding (-1) gathers token 0, masked out by num_drafts
    p_draft = target_probs[:, :k].gather(2, drafts[..., None])[..., 0] / mass[:, :k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, drafts[..., None])[..., 0] / draft_probs.sum(dim=-1)
    accepted = _accepted(u[:, :k] * q_draft < p_draft, num_drafts)  # u < p/q, without dividing by q
    row = torch.arange(rows, device=target_probs.device)
    final = target_probs[row, accepted] / mass[row, accepted][:, None]  # [B, V]
    rejected = accepted < num_drafts
    if k:  # computed for every row rather than asking the device which were rejected (a host sync)
        at = accepted.clamp(max=k - 1)
        if draft_probs is None:
            residual = final.scatter(1, drafts[row, at][:, None], 0.0)
        else:
            q = draft_probs[row, at]
            residual = (final - q / q.sum(dim=-1, keepdim=True)).clamp_(min=0.0)
        # p == q to the last bit leaves no residual mass, but then the draft was accepted: the guard is for rounding
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, final)
        final = torch.where(rejected[:, None], residual, final)
    tokens = _emitted(torch.cat([draft_tokens, draft_tokens.new_zeros(rows, 1)], dim=1), accepted)
    tokens[row, accepted] = _inverse_cdf(final, u[:, k])
    return tokens, accepted + 1


def _accepted(match: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Each row's accepted drafts [B]: its leading run of matches among its real drafts."""
    real = torch.arange(match.shape[1], device=match.device) < num_drafts[:, None]
    return (match & real).long().cumprod(dim=1).sum(dim=1)


def _emitted(tokens: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """`tokens` [B, K+1] with everything past each row's accepted + 1 set to -1."""
    past = torch.arange(tokens.shape[1], device=tokens.device) > accepted[:, None]
    return tokens.masked_fill(past, -1)


def _uniforms(rows: int, positions: int, generator: torch.Generator | Sequence[torch.Generator] | None,
              device: torch.device) -> torch.Tensor:
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(rows, positions, device=device, generator=generator)
    if len(generator) != rows:
        raise ValueError(f"{len(generator)} generators for {rows} rows")
    return torch.stack([torch.rand(positions, device=device, generator=g) for g in generator])


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token a row [B] from non-negative `weights` [B, V] by its uniform u [B], as the sampler draws."""
    cdf = weights.cumsum(dim=-1)
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=weights.shape[-1] - 1)
    # u * mass rounding up to the mass itself would pass the last token of weight: take the row's top one then
    return torch.where(weights.gather(1, chosen[:, None])[:, 0] > 0, chosen, weights.argmax(dim=-1))

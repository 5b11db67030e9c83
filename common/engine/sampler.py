"""Turns a batch of logits into next tokens, each row with its own sampling parameters."""
from __future__ import annotations

import numpy as np
import torch
import xxhash

from common.engine.grammar_mask import GrammarMasks
from common.engine.greedy import greedy_tokens
from common.engine.host_upload import upload
from common.engine.penalties import adjusted_logits
from common.engine.request import Request, TokenLogprob


def _row_generator(seed: int, step: int, index: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
    # Seeded per (seed, choice, output position): the same request draws the same tokens in every
    # mode (aggregated, prefill→decode, a step launched ahead or not) and after a preemption; choice 0 draws
    # what n=1 draws. (A device's generator streams differ from the CPU's: a seed draws alike on one kind.)
    g = torch.Generator(device=device)
    key = f"{seed}:{step}" if index == 0 else f"{seed}/{index}:{step}"
    g.manual_seed(xxhash.xxh64_intdigest(key.encode()) & (2**63 - 1))
    return g


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row's `_kept_probs`, as logits: -inf where filtered out."""
    probs = _kept_probs(logits[None], [top_k], [top_p], [min_p])[0]
    return logits.masked_fill(probs == 0, float("-inf"))


# The CPU finds a nucleus among each row's most likely tokens first (torch.sort of a 49k vocabulary takes ~3.6 ms a
# row on one core, topk of 256 ~0.17 ms), sorting the whole row only where they hold less than top_p.
_NUCLEUS_HEAD = 256


def _kept_probs(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Each row's probabilities (softmax of `logits`, temperature applied) after top-k, then top-p (nucleus), then
    min-p, each with its own values (top_k 0, top_p 1, min_p 0: off); zero where filtered out, not renormalised.
    Each rule keeps the tokens at or above a threshold it computes from the row's values (the k-th logit; the
    probability of the token whose cumulative mass reaches top_p; min_p of the top probability), so which tokens
    it keeps does not depend on how ties are ordered or how the threshold was found. The values cross to the
    device as a step's metadata does; on a GPU nothing waits for it."""
    vocab, device = logits.shape[-1], logits.device
    if any(k > 0 for k in top_k):
        widest = min(max(top_k), vocab)
        k, on = upload([[min(k, vocab) - 1 if k > 0 else 0 for k in top_k], np.asarray(top_k) > 0], device)
        kth = logits.topk(widest, dim=-1).values.gather(1, k[:, None])
        logits = logits.masked_fill((logits < kth) & on[:, None], float("-inf"))
    probs = logits.softmax(dim=-1)
    if any(p < 1.0 for p in top_p):
        (p,) = upload([np.asarray(top_p, dtype=np.float32)], device)
        floor = torch.where(p < 1.0, _nucleus_floor(probs, p, top_p), 0.0)
        probs = probs.masked_fill(probs < floor[:, None], 0.0)
    if any(m > 0.0 for m in min_p):
        (m,) = upload([np.asarray(min_p, dtype=np.float32)], device)
        probs = probs.masked_fill(probs < m[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _nucleus_floor(probs: torch.Tensor, p: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Each row's smallest kept probability under top-p: that of the token whose cumulative mass (tokens in
    descending order) first reaches p (the token that crosses is kept)."""
    def floor_of(ranked: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        before = ranked.cumsum(dim=-1) - ranked
        kept = (before < p[:, None]).sum(dim=-1, keepdim=True).clamp(min=1)
        return ranked.gather(1, kept - 1)[:, 0]

    vocab = probs.shape[-1]
    if probs.device.type != "cpu" or vocab <= _NUCLEUS_HEAD:
        return floor_of(probs.sort(dim=-1, descending=True).values, p)
    head = probs.topk(_NUCLEUS_HEAD, dim=-1).values
    floor = floor_of(head, p)
    short = [i for i, (mass, want) in enumerate(zip(head.sum(dim=-1).tolist(), top_p)) if want < 1.0 and mass < want]
    if short:  # the head holds less than top_p: the whole row, ranked
        rows = torch.tensor(short)
        floor[rows] = floor_of(probs[rows].sort(dim=-1, descending=True).values, p[rows])
    return floor


class Sampler:
    def __init__(self, seed: int = 0):
        self._seed = seed
        self._unseeded: dict[torch.device, torch.Generator] = {}
        self.masks = GrammarMasks()  # the engine's grammar bitmask buffers (the runner masks greedy rows with them)

    def _grammar_masked(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each row with a grammar keeps only the tokens its grammar allows next (-inf elsewhere); the others as
        they are. In place, unless logprobs are asked for: they stay those of the raw logits, as without a grammar.
        A greedy row whose argmax its grammar allows keeps its logits too, on the CPU (GrammarMasks.unfilled): its
        token is the same."""
        grammars = [r.grammar for r in requests]
        if all(g is None for g in grammars):
            return logits
        if any(r.sampling.logprobs for r in requests):
            logits = logits.clone()
        if logits.device.type == "cpu":
            greedy = [r.sampling.greedy and not r.sampling.adjusts_logits for r in requests]
            if any(g is not None and ok for g, ok in zip(grammars, greedy)):
                grammars = self.masks.unfilled(logits, grammars, greedy)
        self.masks.apply(logits, grammars)
        return logits

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 draws: list[int] | None = None) -> list[tuple[int, TokenLogprob | None]]:
        """logits [B, V] float32, raw from the model. Logprobs are of the raw distribution, as HF's output_logits.
        `draws`: each row's output position (default: its output so far; a step launched ahead is one further).
        Host syncs: one for the tokens, one for all the logprobs asked for."""
        raw, logits = logits, self._grammar_masked(logits, requests)
        adjusted = [i for i, r in enumerate(requests) if r.sampling.adjusts_logits]
        if adjusted:  # penalties and biases for all those rows at once, in place of theirs
            index = torch.tensor(adjusted, device=logits.device)
            logits = logits.index_copy(0, index, adjusted_logits(logits[index], [requests[i] for i in adjusted]))
        drawn = self.draw(logits, requests, draws)
        want = [i for i, r in enumerate(requests) if r.sampling.logprobs]
        tops = [requests[i].sampling.top_logprobs for i in want]
        packed = logprobs_on_device(raw, want, drawn, tops) if want else None
        return with_logprobs(drawn.tolist(), want, tops, None if packed is None else packed.tolist())

    def draw(self, logits: torch.Tensor, requests: list[Request], draws: list[int] | None = None) -> torch.Tensor:
        """Each row's token [B] on the logits' device, without waiting for it: greedy rows their argmax, the others
        sampled at their temperature after top-k, top-p and min-p, by one uniform from the row's generator (seeded
        per output position: a step launched ahead draws what a synchronous one draws). The logits as the requests'
        own rules leave them (grammar masks, penalties: `__call__`)."""
        sampled = [i for i, r in enumerate(requests) if not r.sampling.greedy]
        if not sampled:
            return greedy_tokens(logits)
        device = logits.device
        params = [requests[i].sampling for i in sampled]
        some = len(sampled) < len(requests)
        index, temperature = upload([sampled, np.asarray([s.temperature for s in params], dtype=np.float32)], device)
        rows = logits.index_select(0, index) if some else logits
        probs = _kept_probs(rows / temperature[:, None].to(rows.dtype), [s.top_k for s in params],
                            [s.top_p for s in params], [s.min_p for s in params])
        u = torch.empty(len(sampled), device=device, dtype=probs.dtype).uniform_(generator=self._unseeded_on(device))
        for j, (i, s) in enumerate(zip(sampled, params)):
            if s.seed is not None:
                step = len(requests[i].output_token_ids) if draws is None else draws[i]
                u[j: j + 1].uniform_(generator=_row_generator(s.seed, step, requests[i].index, device))
        # Inverse CDF over the kept mass, in vocabulary order: one uniform a row, no host copy.
        cdf = probs.cumsum(dim=-1)
        chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
        # (u * mass rounding up to the mass itself would pass the last kept token: take the row's top one then)
        chosen = torch.where(probs.gather(1, chosen[:, None])[:, 0] > 0, chosen, probs.argmax(dim=-1))
        return greedy_tokens(logits).index_copy(0, index, chosen) if some else chosen

    def _unseeded_on(self, device: torch.device) -> torch.Generator:
        """Unseeded rows' generator on `device` (one a device, seeded with the engine's seed)."""
        generator = self._unseeded.get(device)
        if generator is None:
            generator = self._unseeded[device] = torch.Generator(device=device)
            generator.manual_seed(self._seed)
        return generator


def logprobs_on_device(logits: torch.Tensor, rows: list[int], tokens: torch.Tensor, tops: list[int]) -> torch.Tensor:
    """Raw-distribution logprobs of `rows`' chosen tokens (`tokens` [B], on the logits' device) and each row's top
    max(tops), packed into one float32 tensor for one host copy (logprobs_from_host reads it); nothing waits."""
    index = upload([rows], logits.device)[0]
    lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = lp.gather(1, tokens.index_select(0, index)[:, None])[:, 0]
    k = max(tops)
    if not k:
        return chosen
    top = torch.topk(lp, k)
    return torch.cat([chosen, top.values.flatten(), top.indices.flatten().to(lp.dtype)])  # ids < 2**24: exact


def logprobs_from_host(host: list[float], rows: list[int], tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
    """logprobs_on_device's values, read: each row's TokenLogprob (its top_logprobs of the max(tops) computed)."""
    n, k = len(rows), max(tops)
    out = []
    for j, (row, want) in enumerate(zip(rows, tops)):
        values, ids = host[n + j * k: n + j * k + want], host[n + n * k + j * k: n + n * k + j * k + want]
        out.append(TokenLogprob(token_id=tokens[row], logprob=host[j], top=[(int(t), v) for t, v in zip(ids, values)]))
    return out


def with_logprobs(tokens: list[int], rows: list[int], tops: list[int],
                  packed: list[float] | None) -> list[tuple[int, TokenLogprob | None]]:
    """(token, logprob) of each row: the TokenLogprob of `rows` from logprobs_on_device's values read back."""
    logprobs: list[TokenLogprob | None] = [None] * len(tokens)
    if packed is not None:
        for i, lp in zip(rows, logprobs_from_host(packed, rows, tokens, tops)):
            logprobs[i] = lp
    return list(zip(tokens, logprobs))

"""Turns a batch of logits into next tokens, each row with its own sampling parameters."""
from __future__ import annotations

import numpy as np
import torch
import xxhash

from common.engine.grammar_mask import GrammarMasks
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
    """One row's `_filter_rows`."""
    return _filter_rows(logits[None], [top_k], [top_p], [min_p])[0]


def _filter_rows(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Top-k, then top-p (nucleus), then min-p, each row its own values (top_k 0, top_p 1, min_p 0: off), masking
    with -inf. A pass runs only where some row asks for it: the batch is sorted at most twice, and not at all
    without top-k or top-p. The values cross to the device as a step's metadata does (no sync)."""
    vocab, device = logits.shape[-1], logits.device
    if any(k > 0 for k in top_k):
        (k,) = upload([[min(k, vocab) if k > 0 else vocab for k in top_k]], device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p < 1.0 for p in top_p):
        (p,) = upload([np.asarray(top_p, dtype=np.float32)], device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the token that crosses top_p; a row at 1.0 keeps everything (a cumulative sum may round past 1)
        drop_sorted = ((probs.cumsum(-1) - probs) >= p[:, None]) & (p < 1.0)[:, None]
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), float("-inf"))
    if any(m > 0.0 for m in min_p):
        (m,) = upload([np.asarray(min_p, dtype=np.float32)], device)
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < m[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


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
        tokens = self.draw(logits, requests, draws).tolist()
        want = [i for i, r in enumerate(requests) if r.sampling.logprobs]
        if not want:
            return [(t, None) for t in tokens]
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        for i, lp in zip(want, _logprobs(raw, want, tokens, [requests[i].sampling.top_logprobs for i in want])):
            logprobs[i] = lp
        return list(zip(tokens, logprobs))

    def draw(self, logits: torch.Tensor, requests: list[Request], draws: list[int] | None = None) -> torch.Tensor:
        """Each row's token [B] on the logits' device, without waiting for it: greedy rows their argmax, the others
        sampled at their temperature after top-k, top-p and min-p by the exponential race (the argmax of p / q, q
        ~ Exp(1) from the row's generator: a draw from p with no cumulative sum and no host copy), so a step
        launched ahead samples as a synchronous one does. The logits as the requests' own rules leave them (grammar
        masks, penalties: `__call__`)."""
        sampled = [i for i, r in enumerate(requests) if not r.sampling.greedy]
        if not sampled:
            return logits.argmax(dim=-1)
        device = logits.device
        params = [requests[i].sampling for i in sampled]
        some = len(sampled) < len(requests)
        index, temperature = upload([sampled, np.asarray([s.temperature for s in params], dtype=np.float32)], device)
        rows = logits.index_select(0, index) if some else logits
        rows = _filter_rows(rows / temperature[:, None].to(rows.dtype), [s.top_k for s in params],
                            [s.top_p for s in params], [s.min_p for s in params])
        probs = rows.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_(generator=self._unseeded_on(device))
        for j, (i, s) in enumerate(zip(sampled, params)):
            if s.seed is not None:
                step = len(requests[i].output_token_ids) if draws is None else draws[i]
                q[j].exponential_(generator=_row_generator(s.seed, step, requests[i].index, device))
        chosen = (probs / q.clamp_(min=torch.finfo(q.dtype).tiny)).argmax(dim=-1)
        return logits.argmax(dim=-1).index_copy(0, index, chosen) if some else chosen

    def _unseeded_on(self, device: torch.device) -> torch.Generator:
        """Unseeded rows' generator on `device` (one a device, seeded with the engine's seed)."""
        generator = self._unseeded.get(device)
        if generator is None:
            generator = self._unseeded[device] = torch.Generator(device=device)
            generator.manual_seed(self._seed)
        return generator


def _logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
    """Raw-distribution logprobs of the chosen tokens and each row's top-n, brought to the host in one copy."""
    index = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[index], dim=-1)
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows], device=logits.device)[:, None])[:, 0]
    k = max(tops)
    top = torch.topk(lp, k) if k else None
    parts = [chosen] + ([top.values.flatten(), top.indices.flatten().to(lp.dtype)] if top is not None else [])
    host = torch.cat(parts).cpu().tolist()  # indices < 2**24 are exact in float32
    n = len(rows)
    out = []
    for j, (row, want) in enumerate(zip(rows, tops)):
        values, ids = host[n + j * k: n + j * k + want], host[n + n * k + j * k: n + n * k + j * k + want]
        out.append(TokenLogprob(token_id=tokens[row], logprob=host[j], top=[(int(t), v) for t, v in zip(ids, values)]))
    return out

"""Turns a batch of logits into next tokens, each row with its own sampling parameters."""
from __future__ import annotations

import torch
import xxhash

from common.engine.grammar_mask import GrammarMasks
from common.engine.penalties import adjusted_logits
from common.engine.request import Request, TokenLogprob


def _row_generator(seed: int, step: int, index: int = 0) -> torch.Generator:
    # Seeded per (seed, choice, output position): the same request draws the same tokens in every
    # mode (aggregated, prefill→decode) and after a preemption; choice 0 draws what n=1 draws.
    g = torch.Generator()
    key = f"{seed}:{step}" if index == 0 else f"{seed}/{index}:{step}"
    g.manual_seed(xxhash.xxh64_intdigest(key.encode()) & (2**63 - 1))
    return g


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Top-k, then top-p (nucleus), then min-p, each masking with -inf (one row)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def _sample_row(logits: torch.Tensor, request: Request, generator: torch.Generator | None) -> int:
    s = request.sampling
    logits = _filter(logits / s.temperature, s.top_k, s.top_p, s.min_p)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


class Sampler:
    def __init__(self, seed: int = 0):
        self._unseeded = torch.Generator()
        self._unseeded.manual_seed(seed)
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

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[tuple[int, TokenLogprob | None]]:
        """logits [B, V] float32, raw from the model. Logprobs are of the raw distribution, as HF's output_logits.
        Host syncs: one for the tokens (plus one per sampled row), one for all the logprobs asked for."""
        raw, logits = logits, self._grammar_masked(logits, requests)
        adjusted = [i for i, r in enumerate(requests) if r.sampling.adjusts_logits]
        penalised: dict[int, torch.Tensor] = {}
        if not adjusted:
            argmax = logits.argmax(dim=-1).tolist()  # one call serves every plain greedy row
        else:  # penalties and biases for all those rows at once; their argmax comes back in the same host copy
            rows = adjusted_logits(logits[torch.tensor(adjusted, device=logits.device)],
                                   [requests[i] for i in adjusted])
            penalised = dict(zip(adjusted, rows))
            argmax = torch.cat([logits.argmax(dim=-1), rows.argmax(dim=-1)]).tolist()
            for i, token in zip(adjusted, argmax[len(requests):]):
                argmax[i] = token
        tokens = []
        for i, req in enumerate(requests):
            s = req.sampling
            if s.greedy:
                tokens.append(argmax[i])
            else:
                row = penalised[i] if s.adjusts_logits else logits[i]
                gen = (_row_generator(s.seed, len(req.output_token_ids), req.index) if s.seed is not None
                       else self._unseeded)
                tokens.append(_sample_row(row, req, gen))
        want = [i for i, r in enumerate(requests) if r.sampling.logprobs]
        if not want:
            return [(t, None) for t in tokens]
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        for i, lp in zip(want, _logprobs(raw, want, tokens, [requests[i].sampling.top_logprobs for i in want])):
            logprobs[i] = lp
        return list(zip(tokens, logprobs))


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

"""Turns a batch of logits into next tokens, each row with its own sampling parameters."""
from __future__ import annotations

import torch
import xxhash

from common.engine.request import Request, TokenLogprob


def _row_generator(seed: int, step: int) -> torch.Generator:
    # Seeded per (seed, output position): the same request draws the same tokens in every
    # mode (aggregated, prefill→decode) and after a preemption.
    g = torch.Generator()
    g.manual_seed(xxhash.xxh64_intdigest(f"{seed}:{step}".encode()) & (2**63 - 1))
    return g


def _apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> None:
    """As Hugging Face: seen tokens' positive logits are divided by the penalty, negative ones multiplied."""
    ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=logits.device)
    seen = logits[ids]
    logits[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)


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

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[tuple[int, TokenLogprob | None]]:
        """logits [B, V] float32, raw from the model. Logprobs are of the raw distribution, as HF's output_logits."""
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(r.sampling.logprobs for r in requests) else None
        argmax = logits.argmax(dim=-1).tolist()  # one call serves every plain greedy row
        results = []
        for i, req in enumerate(requests):
            s = req.sampling
            row = logits[i]
            if s.repetition_penalty != 1.0:
                row = row.clone()
                _apply_repetition_penalty(row, req.all_token_ids, s.repetition_penalty)
            if s.greedy:
                token = argmax[i] if s.repetition_penalty == 1.0 else int(torch.argmax(row).item())
            else:
                gen = _row_generator(s.seed, len(req.output_token_ids)) if s.seed is not None else self._unseeded
                token = _sample_row(row, req, gen)
            logprob = None
            if raw_logprobs is not None and s.logprobs:
                lp = raw_logprobs[i]
                top = torch.topk(lp, s.top_logprobs) if s.top_logprobs else None
                logprob = TokenLogprob(
                    token_id=token,
                    logprob=float(lp[token]),
                    top=list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
                )
            results.append((token, logprob))
        return results

"""Logit biases and penalties, applied together to every row of a batch that asks for any, in vLLM's order:
logit_bias, then repetition_penalty (over prompt and output, as Hugging Face), then OpenAI's presence and frequency
penalties over the output so far: logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0).

One sparse update per kind for all rows (not a loop of per-row tensor ops, nor a [rows, vocab] matrix): only the
tokens a row holds or biases change. Rows that ask for none never come here (the sampler's batched greedy path keeps
them)."""
from __future__ import annotations

import torch

from common.engine.request import Request


def adjusted_logits(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """A penalised copy of `logits` [R, V], one row per request."""
    out = logits.clone()
    _add_biases(out, requests)
    _repetition(out, requests)
    _presence_and_frequency(out, requests)
    return out


def _index(rows: list[int], ids: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(rows, device=device), torch.tensor(ids, device=device)


def _add_biases(logits: torch.Tensor, requests: list[Request]) -> None:
    rows, ids, biases = [], [], []
    for row, request in enumerate(requests):
        for token, bias in request.sampling.logit_bias:
            rows.append(row)
            ids.append(token)
            biases.append(bias)
    if rows:
        logits.index_put_(_index(rows, ids, logits.device), torch.tensor(biases, dtype=logits.dtype,
                                                                          device=logits.device), accumulate=True)


def _repetition(logits: torch.Tensor, requests: list[Request]) -> None:
    """As Hugging Face: a seen token's positive logit is divided by the penalty, a negative one multiplied."""
    rows, ids, penalty = [], [], [1.0] * len(requests)
    for row, request in enumerate(requests):
        if request.sampling.repetition_penalty != 1.0:
            seen = set(request.all_token_ids)
            rows += [row] * len(seen)
            ids += seen
            penalty[row] = request.sampling.repetition_penalty
    if not rows:
        return
    index = _index(rows, ids, logits.device)
    seen_logits = logits[index]
    by_row = torch.tensor(penalty, dtype=logits.dtype, device=logits.device)[index[0]]
    logits[index] = torch.where(seen_logits > 0, seen_logits / by_row, seen_logits * by_row)


def _presence_and_frequency(logits: torch.Tensor, requests: list[Request]) -> None:
    """Only the (row, token) pairs the outputs hold change: counted with one unique(), updated with one index_add_
    (no [rows, vocab] count matrix)."""
    rows, ids, presence, frequency = [], [], [], []
    for row, request in enumerate(requests):
        s = request.sampling
        if (s.presence_penalty or s.frequency_penalty) and request.output_token_ids:
            rows += [row] * len(request.output_token_ids)
            ids += request.output_token_ids
        presence.append(s.presence_penalty)
        frequency.append(s.frequency_penalty)
    if not rows:
        return
    vocab = logits.shape[-1]
    row_index, token_index = _index(rows, ids, logits.device)
    keys, counts = torch.unique(row_index * vocab + token_index, return_counts=True)
    of_row = keys // vocab
    as_tensor = lambda values: torch.tensor(values, dtype=logits.dtype, device=logits.device)  # noqa: E731
    penalty = as_tensor(frequency)[of_row] * counts.to(logits.dtype) + as_tensor(presence)[of_row]
    logits.view(-1).index_add_(0, keys, -penalty)

"""Hugging Face transformers as the reference: greedy tokens and raw logprobs."""
from __future__ import annotations

from functools import lru_cache

import torch
from transformers import AutoModelForCausalLM


@lru_cache(maxsize=8)
def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(path: str, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> tuple[list[int], list[float]]:
    """Greedy continuation and the raw-logit logprob of each chosen token.

    With stop_at_eos this is `generate` itself. Without, it is generate's greedy loop written out
    over the HF model's forward and cache: `generate(min_new_tokens=...)` would instead mask eos and
    pick the runner-up, which is not what an engine ignoring eos computes.
    """
    model = hf_model(path)
    if stop_at_eos:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        return tokens, [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.logits, tokens)]
    tokens, logprobs = [], []
    out = model(torch.tensor([prompt]), use_cache=True)
    for _ in range(max_new_tokens):
        logits = out.logits[0, -1].float()
        token = int(torch.argmax(logits))
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs

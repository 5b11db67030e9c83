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
    """Greedy continuation and the raw-logit logprob of each chosen token."""
    model = hf_model(path)
    extra = {} if stop_at_eos else {"min_new_tokens": max_new_tokens}
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0, **extra,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens)]
    return tokens, logprobs

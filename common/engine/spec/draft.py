"""Draft-model drafts: a smaller model with the target's tokenizer continues each row greedily for k tokens.

The draft runs in an engine of our own (LLMEngine, the class every worker runs) on the target's device and dtype,
with its own paged KV pool and prefix cache. Each step's rows become that engine's requests at once (prompt: the
row's prompt and output so far; k greedy tokens) and run in one batched loop to their end: the draft's prefix cache
holds every full block of a row's context from the step before, so each proposal prefills only the tokens past the
last full block (the ones the target accepted since, and at most a block before them). Nothing is held between
steps but those cached blocks, which are evictable: a finished or cancelled target request leaves no draft
request and no held block behind. Its pool holds as many tokens as the target's, and K more for each of
--max-num-seqs rows, so a step's rows never preempt each other there.
"""
from __future__ import annotations

import itertools
import logging

import numpy as np

from common.engine.request import SamplingParams
from common.engine.spec.config import FLAG, SpeculativeConfig
from common.engine.spec.memory import draft_rows_blocks
from common.errors import DisaggError, InvalidConfig
from common.model_facts import load_model_facts
from common.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(self, engine, target_vocab_size: int):
        """`engine`: the draft's LLMEngine; drafts are cut before a token outside the target's vocabulary (a draft
        vocabulary padded wider than the target's)."""
        self.engine = engine
        self.target_vocab_size = target_vocab_size
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target) -> "DraftModelProposer":
        """The draft engine for the target LLMEngine `target`; InvalidConfig names both models where their
        vocabularies differ."""
        from common.engine.engine import LLMEngine

        if config.draft_tensor_parallel_size not in (None, 1):
            raise InvalidConfig(f"{FLAG}: a draft model runs on one device (draft_tensor_parallel_size 1), got "
                                f"{config.draft_tensor_parallel_size}")
        check_same_vocabulary(config.model, target.config.model)
        t = target.config
        rows_k = draft_rows_blocks(config, t.max_num_seqs, t.block_size)
        draft = LLMEngine(t.replace(
            model=config.model, num_kv_blocks=target.block_manager.num_blocks + rows_k,
            gpu_memory_utilization=None, max_model_len=None, speculative_config=None, tensor_parallel_size=1,
            host_kv_cache_gb=0.0, disk_kv_cache_dir=None, disk_kv_cache_gb=0.0, kv_cache_write_through=False,
            enable_prefix_caching=True, quantization=None, kv_cache_dtype="auto"))
        log.info("speculative decoding: draft model %s, %d KV blocks", config.model, draft.block_manager.num_blocks)
        return cls(draft, target.vocab_size)

    def propose(self, token_ids, k: int) -> list[int]:
        return self.propose_many([token_ids], [k])[0]

    def propose_many(self, histories: list, ks: list[int], request_ids: list[str] | None = None) -> list[list[int]]:
        """Each row's greedy draft of up to ks[i] tokens after histories[i] (prompt + output), all rows run in the
        draft engine together; [] for a row the draft cannot take (its context past the draft's)."""
        engine = self.engine
        ids: dict[str, int] = {}
        try:
            for row, (history, k) in enumerate(zip(histories, ks, strict=True)):
                if k < 1 or len(history) + k > engine.max_model_len:
                    continue
                request_id = f"draft-{next(self._ids)}"
                engine.add_request(request_id, np.asarray(history).tolist(),
                                   SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))
                ids[request_id] = row
            drafts: list[list[int]] = [[] for _ in histories]
            while engine.has_unfinished_requests():
                for out in engine.step():
                    drafts[ids[out.request_id]] += out.new_token_ids
        except DisaggError as exc:  # a draft that cannot run must not fail the target's step: it runs plain
            log.warning("draft model: no drafts this step (%s: %s)", type(exc).__name__, exc)
            drafts = [[] for _ in histories]
        finally:
            for request_id in ids:
                engine.abort_request(request_id)  # (no-op for those that ended)
            while engine.has_unfinished_requests():
                engine.step()
        return [self._in_vocab(d) for d in drafts]

    def _in_vocab(self, draft: list[int]) -> list[int]:
        for i, token in enumerate(draft):
            if token >= self.target_vocab_size:
                return draft[:i]
        return draft

    def forget(self, request_id: str) -> None:
        """(Nothing to free: the draft engine holds no request between steps.)"""

    def close(self) -> None:
        self.engine.close()


def check_same_vocabulary(draft_dir: str, target_dir: str) -> None:
    """InvalidConfig naming both models unless the draft's tokens are the target's: the same vocabulary, added tokens
    included, where both directories have a tokenizer, or else the same vocabulary size."""
    draft, target = load_tokenizer(draft_dir), load_tokenizer(target_dir)
    if draft is not None and target is not None:
        if draft.hf.get_vocab() != target.hf.get_vocab():
            raise InvalidConfig(f"{FLAG}: draft model {draft_dir} has another tokenizer than the target "
                                f"{target_dir} (their vocabularies differ); a draft must share the target's tokenizer")
        return
    draft_size, target_size = load_model_facts(draft_dir).vocab_size, load_model_facts(target_dir).vocab_size
    if draft_size != target_size:
        raise InvalidConfig(f"{FLAG}: draft model {draft_dir} has a vocabulary of {draft_size} tokens, the target "
                            f"{target_dir} one of {target_size}; a draft must share the target's tokenizer")

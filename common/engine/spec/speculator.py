"""Speculative decoding in the engine: drafts for its decode rows before a step, and what the step accepted of them.

Before a step, each decode row that may speculate (`eligible`) gets up to K draft tokens from the proposer (n-gram
prompt lookup over its own prompt and output; a draft model or an EAGLE-3 head, which draft the step's rows in one
batched loop), K chosen by its acceptance so far (acceptance.py) under the step costs measured at start (costs.py).
The scheduler gives such a row 1 + K tokens; the step computes the KV of its last token and of every draft and
samples each of the K + 1 positions as a plain row would sample it there (its own seeded draw for that output
position). The row then emits the drawn tokens up to and including the first that differs from its draft (`accept`):
for a greedy row the longest prefix of drafts equal to the target's argmax and the target's next token; for a
sampled row this is rejection sampling for a draft distribution that is one token (accept the draft with the
target's probability of it, else draw from the target without it), so the emitted tokens follow the target's
distribution exactly. The KV of a rejected draft lies past the row's computed tokens and is overwritten by the next
step; only accepted tokens reach the prefix cache, the KV events and a handoff.
"""
from __future__ import annotations

import bisect
import logging

from common.engine.request import Request, RequestType, TokenLogprob
from common.engine.spec.acceptance import AcceptancePolicy, AcceptanceTracker
from common.engine.spec.config import SpeculativeConfig
from common.engine.spec.history import TokenHistory
from common.engine.spec.metrics import SpecMetrics
from common.engine.spec.proposer import make_proposer
from common.engine.spec.verify import greedy_accept

log = logging.getLogger(__name__)

Drawn = tuple[int, TokenLogprob | None]


class _RowState:
    def __init__(self, request: Request, policy: AcceptancePolicy):
        self.history = TokenHistory(request.prompt_token_ids)
        self.tracker = AcceptanceTracker(policy)


class Speculator:
    def __init__(self, config: SpeculativeConfig, policies: dict[int, AcceptancePolicy] | None = None, target=None):
        """`policies`: batch size -> the acceptance policy of the step costs measured at that batch size (the
        nearest smaller one applies); None: until measured, a draft costs a tenth of a plain row. `target`: the
        LLMEngine speculating (a draft model is built for it)."""
        self.config = config
        self.method = config.method
        self.proposer = make_proposer(config, target)
        self.metrics = SpecMetrics()
        self.set_policies(policies or {1: AcceptancePolicy.linear(config.num_speculative_tokens, 0.1)})
        self._rows: dict[str, _RowState] = {}
        self.forced_k: int | None = None  # costs.py: every eligible row drafts exactly this many (timing only)

    def set_policies(self, policies: dict[int, AcceptancePolicy]) -> None:
        self._batches = sorted(policies)
        self._policies = [policies[b] for b in self._batches]

    def policy_for(self, batch: int) -> AcceptancePolicy:
        return self._policies[max(bisect.bisect_right(self._batches, batch) - 1, 0)]

    @staticmethod
    def eligible(request: Request) -> bool:
        """A decode row whose next tokens the step's sampled positions decide alone: no grammar (its mask needs
        each token accepted first), no penalty or bias (they count the tokens before, drafts included), no
        context_only prompt (it stops at its first token)."""
        return (request.request_type is not RequestType.CONTEXT_ONLY and request.grammar is None
                and not request.sampling.adjusts_logits and request.num_tokens - request.num_computed_tokens == 1)

    def propose(self, running: list[Request]) -> None:
        """Set each eligible row's drafts for the next step (at most what it may still emit less its own token)."""
        rows = [r for r in running if self.eligible(r)]
        if not rows:
            return
        policy = self.policy_for(len(running))
        wanted: list[tuple[Request, int, object]] = []  # (row, its k, its history) for the rows that draft
        for request in rows:
            state = self._rows.get(request.request_id)
            if state is None:
                state = self._rows[request.request_id] = _RowState(request, policy)
            left = request.max_total_tokens - request.num_tokens - 1
            k = min(self.forced_k if self.forced_k is not None else policy.best_k(state.tracker.rate), left)
            request.draft_token_ids = []
            if k > 0:
                wanted.append((request, k, state.history.update(request.output_token_ids)))
            else:
                self._plain(request, "off")
        for (request, k, history), drafts in zip(wanted, self._drafts(wanted), strict=True):
            if self.forced_k is not None:  # (costs.py: the proposer's time counted, every row drafting k)
                drafts = (list(drafts) + [int(history[-1])] * k)[:k]
            if drafts:
                request.draft_token_ids = drafts
            else:
                self._plain(request, "no_draft")

    def _drafts(self, wanted: list) -> list[list[int]]:
        if not wanted:
            return []
        if hasattr(self.proposer, "propose_many"):  # (BatchedProposer: the step's rows in one go)
            return self.proposer.propose_many([h for _, _, h in wanted], [k for _, k, _ in wanted],
                                              [r.request_id for r, _, _ in wanted])
        return [self.proposer.propose(history, k) for _, k, history in wanted]

    def _plain(self, request: Request, reason: str) -> None:
        """A plain row this step: its evidence ages (a stopped request probes again in time)."""
        self._rows[request.request_id].tracker.record(0, 0)
        self.metrics.plain(self.method, reason)

    def wants_drafts(self, running: list[Request]) -> bool:
        """Whether a row would draft in the next step (its K above 0): the engine then schedules that step itself,
        after reading this one's tokens, rather than launch it ahead (async scheduling) without drafts."""
        if self.forced_k is not None:
            return self.forced_k > 0
        policy = self.policy_for(len(running))
        for request in running:
            state = self._rows.get(request.request_id)
            rate = state.tracker.rate if state is not None else None
            if self.eligible_next(request) and policy.best_k(policy.prior_rate if rate is None else rate) > 0:
                return True
        return False

    @staticmethod
    def eligible_next(request: Request) -> bool:
        """`eligible` for the step after the one running: a decode row then (a prompt whose last chunk runs now too)."""
        return (request.request_type is not RequestType.CONTEXT_ONLY and request.grammar is None
                and not request.sampling.adjusts_logits and request.num_tokens + 1 < request.max_total_tokens)

    @staticmethod
    def clear_unscheduled(running: list[Request], scheduled: list[Request]) -> None:
        chosen = set(map(id, scheduled))
        for request in running:
            if request.draft_token_ids and id(request) not in chosen:
                request.draft_token_ids = []

    def accept(self, request: Request, drawn: list[Drawn]) -> list[Drawn]:
        """What a row that verified drafts emits: its drawn tokens up to and including the first that is not its
        draft there (`drawn`: one a position, the row's last token's first). Records the outcome."""
        drafts, request.draft_token_ids = request.draft_token_ids, []
        accepted = len(greedy_accept([token for token, _ in drawn], drafts)) - 1  # (drawn: argmax or sampled)
        state = self._rows.get(request.request_id)
        if state is not None:
            state.tracker.record(len(drafts), accepted)
        self.metrics.verified(self.method, [len(drafts)], [accepted])
        return drawn[: accepted + 1]

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
        self.proposer.forget(request_id)

    def close(self) -> None:
        self.proposer.close()

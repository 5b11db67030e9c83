"""LLMEngine: add requests, step, abort. One class for the three modes of TensorRT-LLM's request_type."""
from __future__ import annotations

import dataclasses
import logging
import time

from common.engine.block_manager import BlockManager
from common.engine.config import EngineConfig, resolve_max_model_len
from common.engine.grammar import Grammars
from common.engine.grammar_backend import CompiledGrammar
from common.engine.model_runner import ModelRunner, StepLaunch
from common.engine.multimodal import ImageEmbedding, MultiModalInputs
from common.engine.request import (FinishReason, Request, RequestOutput, RequestStatus, RequestType,
                                   SamplingParams, TokenLogprob, check_fits_context)
from common.engine.scheduler import Scheduler
from common.engine.spec.speculator import Speculator
from common.engine.step_facts import StepFacts, step_facts
from common.engine.stopping import StopRule
from common.engine.interface import EngineLoad, KvBlocks
from common.errors import InvalidRequest, NotFound, ResourceExhausted
from common.kv.events import KvEventLog
from common.kv.layout import KvExport, PlacedKv, model_fingerprint
from common.kv.session import KvSession, KvSessionTable
from common.kv.tiers import KvTiers, open_tiers, weights_identity
from common.model_facts import load_model_facts

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        hf = self.runner.hf_config
        self.vocab_size: int = hf.vocab_size
        self.max_model_len = resolve_max_model_len(config, hf.max_position_embeddings)
        # Weights quantised at load change the KV; an FP8 checkpoint says so in its config (the flag is a no-op there).
        at_load = config.quantization and getattr(hf, "quantization_config", None) is None
        quantized = {"quantization": config.quantization} if at_load else {}
        self.fingerprint = model_fingerprint(hf, config.dtype,
                                             {**self.runner.kv_format.fingerprint_fields(), **quantized})
        self.kv_layout = self.runner.layout(self.fingerprint)
        facts = load_model_facts(config.model)
        self.eos_token_ids = facts.eos_token_ids
        self.image_token_id = facts.image_token_id
        self.grammars = Grammars(config.model, self.vocab_size, self.eos_token_ids,  # structured output's
                                 config.structured_output_backend)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        # What enters and leaves the prefix cache, for Worker.SubscribeKvEvents (None without a prefix cache).
        self.kv_events = KvEventLog(config.block_size) if config.enable_prefix_caching else None
        self.block_manager.events = self.kv_events
        self.block_manager.tiers = self._open_tiers(config)
        if self.kv_tiers is not None:
            self.kv_tiers.events = self.kv_events  # each tier's blocks are KV events too (the router scores them)
            self.kv_tiers.announce_held()
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.prefill_chunk_limit, config.kv_growth_reserve)
        self.sessions = KvSessionTable(config.session_ttl_s)
        self.requests: dict[str, Request] = {}
        self._stop_rules: dict[str, StopRule] = {}
        self._groups: dict[str, list[Request]] = {}  # n > 1: the leader's id -> every choice, while any runs
        self.num_preemptions = 0
        # Speculative decoding (None: off): drafts for the decode rows before each step, their acceptance after.
        self.speculator = (Speculator(config.speculative_config, target=self)
                           if config.speculative_config is not None else None)
        # Async scheduling (default: where decode steps run as CUDA graphs, i.e. where the host is the bottleneck);
        # with speculation only for steps in which no row drafts (a row's drafts continue the tokens read before).
        self.async_scheduling = (self.runner.graphs is not None if config.async_scheduling is None
                                 else config.async_scheduling)
        self._ahead: StepLaunch | None = None  # the decode step launched before the last one was read
        self.last_step: StepFacts | None = None  # what the last step() ran (None: it ran nothing)

    # --- requests ---

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        request_type: RequestType = RequestType.CONTEXT_AND_GENERATION,
        kv_import: KvExport | None = None,
        first_token: int | None = None,
        images: list[ImageEmbedding] | None = None,
        more_first_tokens: list[int] | None = None,
        choices: list[int] | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> Request:
        """n > 1 (sampling.n, or `choices`, the choice indices this engine runs, leader first): one request per
        choice; generation_only takes each choice's first token (`first_token`, then `more_first_tokens`)."""
        sampling = sampling or SamplingParams()
        choices = list(choices) if choices else list(range(sampling.n))
        self._validate(request_id, prompt_token_ids, request_type, kv_import, first_token)
        self._validate_choices(sampling, choices, request_type, more_first_tokens or [])
        mm = self._multimodal(prompt_token_ids, images, kv_import is not None)
        if sampling.structured is not None and grammar is None:  # (AsyncLLMEngine compiles it off this thread)
            grammar = self.grammars.compile(sampling.structured)
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise ResourceExhausted(f"the engine queue is full: {self.config.max_waiting} requests waiting, its limit "
                                    "(--max-waiting); retry later or add workers")
        # A lone request must always fit in the pool, or preemption would loop forever.
        cap = min(self.max_model_len, self.block_manager.num_blocks * self.config.block_size)
        rule = StopRule.of(sampling, self.eos_token_ids, len(prompt_token_ids), cap)
        request = Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling=sampling,
            request_type=request_type, kv_import=kv_import, max_total_tokens=rule.max_total_tokens,
            arrival_time=time.monotonic(), mm=mm, index=choices[0],
        )
        if first_token is not None:
            request.output_token_ids.append(first_token)
        firsts = more_first_tokens or [None] * (len(choices) - 1)
        request.forks = [dataclasses.replace(request, request_id=f"{request_id}#{i}", index=i, group_id=request_id,
                                             output_token_ids=[] if t is None else [t], block_table=[],
                                             block_hashes=[], forks=[], kv_import=None, prompt_logprobs=[],
                                             draft_token_ids=[])
                         for i, t in zip(choices[1:], firsts)]
        if grammar is not None:  # each choice its own state, past its first token if it has one
            for member in (request, *request.forks):
                member.grammar = grammar.after(member.output_token_ids)
        if isinstance(kv_import, PlacedKv):  # already in our blocks: the request takes them over
            request.block_table = kv_import.adopt() or []
            if not request.block_table:
                raise InvalidRequest(f"the KV imported for {request_id!r} was discarded before the engine took it")
        self.requests[request_id] = request
        self._stop_rules[request_id] = rule
        for child in request.forks:  # they wait in the leader until its prompt's KV is complete (_fork)
            self.requests[child.request_id] = child
            self._stop_rules[child.request_id] = rule
        if request.forks:
            self._groups[request_id] = [request, *request.forks]
        self.scheduler.add(request)
        self.block_manager.prefetch(request)  # (tiers: its blocks past the device's come up meanwhile)
        return request

    def _open_tiers(self, config: EngineConfig) -> KvTiers | None:
        if not config.kv_tiers_asked:  # (before weights_identity, which reads the weights files)
            return None
        return open_tiers(self.runner.kv_cache, self.kv_layout, weights_identity(config.model, config.load_format,
                                                                                 config.dummy_seed),
                          self.block_manager.num_blocks, config.host_kv_cache_gb, config.disk_kv_cache_dir,
                          config.disk_kv_cache_gb, config.kv_cache_write_through)

    def _validate_choices(self, sampling: SamplingParams, choices: list[int], request_type: RequestType,
                          more_first_tokens: list[int]) -> None:
        sampling.check_vocab(self.vocab_size)
        if len(set(choices)) != len(choices) or not all(0 <= i < SamplingParams.MAX_N for i in choices):
            raise InvalidRequest(f"choices must be distinct indices in [0, {SamplingParams.MAX_N}), got {choices}")
        wanted = len(choices) - 1 if request_type is RequestType.GENERATION_ONLY else 0
        if len(more_first_tokens) != wanted:
            raise InvalidRequest(f"{len(more_first_tokens)} more first tokens for {len(choices)} choices of a "
                                 f"{request_type.value} request; it takes {wanted}")
        bad = [t for t in more_first_tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"first tokens outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    def _validate(self, request_id, prompt, request_type, kv_import, first_token) -> None:
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if not prompt:
            raise InvalidRequest("prompt is empty")
        check_fits_context(len(prompt), None, self.max_model_len)
        if -(-(len(prompt) + 1) // self.config.block_size) > self.block_manager.num_blocks:
            raise InvalidRequest(f"prompt has {len(prompt)} tokens; the KV pool holds only "
                                 f"{self.block_manager.num_blocks * self.config.block_size}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if request_type is RequestType.GENERATION_ONLY:
            # Without kv_import the prompt's KV is recomputed here (kv_load_failure_policy=recompute),
            # the way a preempted request is: prompt + first token are run, then generation goes on.
            if first_token is None:
                raise InvalidRequest("generation_only needs the first token the context phase sampled")
            if not 0 <= first_token < self.vocab_size:
                raise InvalidRequest(f"first token {first_token} is outside the vocabulary [0, {self.vocab_size})")
            if kv_import is None:
                return
            self.kv_layout.check_compatible(kv_import.layout)
            kv_import.validate()
            if kv_import.num_tokens != len(prompt):
                raise InvalidRequest(f"imported KV covers {kv_import.num_tokens} tokens, the prompt has {len(prompt)}")
        elif kv_import is not None or first_token is not None:
            raise InvalidRequest(f"{request_type.value} takes no imported KV or first token")

    def _multimodal(self, prompt: list[int], images: list[ImageEmbedding] | None,
                    imported: bool) -> MultiModalInputs | None:
        hidden = self.runner.hf_config.hidden_size
        if images:
            return MultiModalInputs.build(prompt, self.image_token_id, images, hidden)
        if self.image_token_id is not None and self.image_token_id in prompt:
            if imported:  # the context phase ran the images; its KV comes with the request
                return MultiModalInputs.imported(prompt, self.image_token_id, hidden)
            raise InvalidRequest(f"the prompt has image placeholder tokens (id {self.image_token_id}) but no images")
        return None

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks; False if it is unknown or already done."""
        return bool(self.abort_members(request_id))

    def abort_members(self, request_id: str) -> list[Request]:
        """Abort a request, every choice of it (the leader's id) or one choice ("<id>#<index>"): those it ended.
        A leader whose prompt is not done yet takes the choices waiting on it along."""
        members = self._groups.get(request_id) or [self.requests.get(request_id)]
        if members == [None] and "#" in request_id:  # the leader's own choice, by its index
            group_id, _, index = request_id.rpartition("#")
            members = [m for m in self._groups.get(group_id, ()) if str(m.index) == index]
            members += [c for m in members for c in m.forks]
        live = [m for m in members if m is not None and self._live(m)]
        for member in live:
            self._finish(member, FinishReason.ABORT)
        return live

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self._ahead is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_tiers(self) -> KvTiers | None:
        """The KV cache tiers below the device pool (None: none), as its block manager holds them."""
        return self.block_manager.tiers

    # --- the loop ---

    def step(self) -> list[RequestOutput]:
        """Run one step and return what it produced. With async scheduling, the next decode step (or a prefill
        worker's next prompt step) is launched before this one's tokens are read, so the GPU runs it while the
        host books this one. Grammar rows go ahead too: the step launched ahead samples here, at the start of the
        next, once the tokens before are booked (each grammar took its token), and its masks are filled while its
        forward still runs."""
        self.expire_sessions()
        self.runner.bind()
        self.scheduler.publish_growth()  # (steps launched ahead schedule no one: an import still sees it fresh)
        launched, self._ahead = self._ahead, None
        launched_ahead, self.last_step = launched is not None, None
        if launched is not None and launched.awaits_masks:
            self.runner.sample_masked(launched, [r.grammar if self._live(r) else None for r in launched.sampled])
        if launched is None:
            if self.speculator is not None:
                self.speculator.propose(self.scheduler.running)
            batch = self.scheduler.schedule()
            if self.speculator is not None:  # a row left out of the step keeps no drafts for a later one
                self.speculator.clear_unscheduled(self.scheduler.running, batch.requests)
            self.num_preemptions += len(batch.preempted)
            for request in batch.kv_imports:
                if isinstance(request.kv_import, KvExport):
                    self.runner.import_blocks(request.block_table, request.kv_import)
                request.kv_import = None
                if request.forks:  # the prompt's KV is in: the other choices take its blocks
                    self._fork(request)
            if batch.empty:
                return []
            self.block_manager.steps_launched += 1
            launched = self.runner.launch(batch)
        self.last_step = step_facts(launched.scheduled, launched_ahead)
        try:
            if self.async_scheduling and (self.speculator is None
                                          or not self.speculator.wants_drafts(self.scheduler.running)):
                self._ahead = (self._launch_ahead(launched) or self._launch_prompts_ahead(launched)
                               or self._launch_mixed_ahead(launched))
            drawn = launched.result()
        except Exception:
            self._ahead = None
            raise
        if not launched.unawaited:  # every step launched so far has written its KV, but the one launched ahead
            self.block_manager.steps_done = self.block_manager.steps_launched - (self._ahead is not None)
        if self.speculator is not None:  # a row with drafts counts its own token computed; each draft it accepts,
            launched.scheduled = [(r, 1 if r.draft_token_ids else n) for r, n in launched.scheduled]  # as taken
        self._book(launched)
        for request, _ in launched.scheduled:
            if self._live(request):
                self.block_manager.commit_full_blocks(request)
                if request.forks and request.num_computed_tokens >= request.num_prompt_tokens:
                    self._fork(request)  # before its token is booked: that may end it and free its blocks
        read_at = time.monotonic()
        if self.speculator is None:
            return [self._append_token(request, token, lp, read_at)
                    for request, (token, lp) in zip(launched.sampled, drawn) if self._live(request)]
        return self._append_verified(launched.sampled, drawn, read_at)

    def _append_verified(self, sampled: list[Request], drawn: list, read_at: float) -> list[RequestOutput]:
        """A step's tokens where rows may have verified drafts: such a row's positions are consecutive in `sampled`,
        one more than its drafts; it emits what the speculator accepts of them, each accepted draft's KV counted
        computed as its token is appended, then its full blocks committed."""
        outputs, i = [], 0
        while i < len(sampled):
            request = sampled[i]
            positions = 1 + len(request.draft_token_ids)
            tokens = drawn[i: i + positions]
            i += positions
            if positions > 1:
                tokens = self.speculator.accept(request, tokens)
            if not self._live(request):
                continue
            output = self._append_token(request, *tokens[0], read_at)
            for token, lp in tokens[1:]:
                if output.finished:
                    break
                request.num_computed_tokens += 1  # the draft now appended before it: its KV is this step's
                more = self._append_token(request, token, lp, read_at)
                more.new_token_ids[:0], more.new_logprobs[:0] = output.new_token_ids, output.new_logprobs
                more.first_scheduled_time, more.first_token_time = output.first_scheduled_time, output.first_token_time
                more.prompt_logprobs = more.prompt_logprobs or output.prompt_logprobs
                output = more
            if len(tokens) > 1 and self._live(request):
                self.block_manager.commit_full_blocks(request)
            outputs.append(output)
        return outputs

    def _fork(self, leader: Request) -> None:
        """The other choices take the leader's full prompt blocks (one more reference each) and queue first, each to
        compute the rest of its prompt (under a block) with its own first token. Context_only choices take nothing:
        they only sampled their first token from the leader's last prompt position."""
        children, leader.forks = leader.forks, []
        if leader.request_type is RequestType.CONTEXT_ONLY:
            return
        full = leader.num_prompt_tokens // self.config.block_size
        for child in reversed([c for c in children if self._live(c)]):
            child.block_table = self.block_manager.share(leader.block_table[:full])
            child.block_hashes = leader.block_hashes[:full]
            child.num_computed_tokens = full * self.config.block_size
            self.scheduler.waiting.appendleft(child)

    def _live(self, request: Request) -> bool:
        """Still this engine's request: not finished or aborted while a step launched ahead computed it."""
        return self.requests.get(request.request_id) is request

    def _launch_ahead(self, launched: StepLaunch) -> StepLaunch | None:
        """Launch the decode step after `launched` before reading its tokens (vLLM's async scheduling), when
        that step is the one the scheduler would make: every running request sampled (no prefill chunk left),
        nobody waits to be admitted, and each row's next position gets a block without preempting anyone.
        Rows that `launched` ends by length are left out; a row that ends on a stop token is computed and
        dropped. Waiting requests that can join it as decode rows (_joins_ahead) are admitted into it; any other
        waiting request stops the pipeline for a schedule(). Its blocks may be freed meanwhile: later steps reuse
        them only after it on the same stream, and the block it writes (past the last computed token) holds no
        prefix-cache hash."""
        running, waiting = self.scheduler.running, self.scheduler.waiting
        live = [i for i, r in enumerate(launched.sampled) if self._live(r)]  # (one launched ahead may hold ended rows)
        if (launched.tokens is None or len(running) != len(live)
                or any(r is not launched.sampled[i] for r, i in zip(running, live))
                or not all(map(self._joins_ahead, waiting))):
            return None
        rows = [i for i in live if (r := launched.sampled[i]).request_type is not RequestType.CONTEXT_ONLY
                # a context_only request's blocks become a session after this step
                and r.num_tokens + 1 < r.max_total_tokens]
        if not rows:
            return None
        for i in rows:
            request = launched.sampled[i]  # room for one more token than `launched` leaves computed
            if not self.block_manager.allocate_slots(request, request.num_tokens + 1 - request.num_computed_tokens):
                return None
        joined = self._admit_joiners(len(rows)) if waiting else []
        self.block_manager.steps_launched += 1
        return self.runner.launch_ahead(launched, rows, joined)

    def _launch_prompts_ahead(self, launched: StepLaunch) -> StepLaunch | None:
        """A prefill worker's next prompt step, launched before `launched`'s first tokens are read: the GPU runs
        it while the host books them and pins their sessions, instead of waiting for the host between every two
        steps. Only where nothing in it depends on those tokens (every request a plain context_only prompt: no
        choices to fork, grammar, images or prompt logprobs; a prompt finished in `launched` just waits for its
        token, out of the next step) and only when the prompts queued already fill the next step: a prompt that
        arrives meanwhile would not have fit in it anyway, so going ahead costs no one a step. The rows of
        `launched` count as computed from here on (`booked`); the step it schedules preempts no one, since a
        victim's blocks may be in `launched`."""
        running, waiting = self.scheduler.running, self.scheduler.waiting
        if launched.awaits_masks or not all(map(self._plain_context, running)) \
                or not all(map(self._plain_context, waiting)):
            return None
        in_flight = sum(n for request, n in launched.scheduled if self._live(request))
        if self.prompt_tokens_to_compute() - in_flight < self.scheduler.max_num_batched_tokens:
            return None
        self._book(launched)
        batch = self.scheduler.schedule(preempt=False)
        if batch.empty:
            return None
        self.block_manager.steps_launched += 1
        return self.runner.launch(batch)

    def _launch_mixed_ahead(self, launched: StepLaunch) -> StepLaunch | None:
        """A mixed step, launched before `launched`'s tokens are read: its decode rows (as `_launch_ahead`'s, each
        feeding the token `launched` sampled for it, still on the device) first, then the prompt chunks the scheduler
        picks with the rest of the budget (their tokens are known). An aggregated worker's steps, and a decode
        worker's that prefill a prompt, would otherwise leave the GPU idle while the host books one step and builds
        the next, about a fifth of a mixed step (`benchmarks/gpu_prefill.py --mixed-batch`). Only
        where every request is plain (`_plain`) and every sampled row drawn on the device; `launched` is booked
        first (its rows count as computed), and the step preempts no one. Where no prompt fits beside the rows (the
        batch's row limit reached, say), they go ahead alone: a waiting prompt no longer stops the pipeline."""
        running, waiting = self.scheduler.running, self.scheduler.waiting
        if (launched.tokens is None or launched.awaits_masks or not all(map(self._plain, running))
                or not all(self._plain(r) and not isinstance(r.kv_import, KvExport) for r in waiting)):
            return None
        rows = [i for i, r in enumerate(launched.sampled) if self._live(r)
                and r.request_type is not RequestType.CONTEXT_ONLY and r.num_tokens + 1 < r.max_total_tokens]
        if not rows:
            return None
        self._book(launched)
        if not all(self.block_manager.allocate_slots(launched.sampled[i], 1) for i in rows):
            return None
        batch = self.scheduler.schedule(preempt=False, reserved=len(rows))  # (the rows themselves: nothing to do)
        self.block_manager.steps_launched += 1
        if batch.empty:  # no prompt fits beside them (a full batch, or no blocks): the decode rows go ahead alone
            return self.runner.launch_ahead(launched, rows)
        for request in batch.kv_imports:
            request.kv_import = None  # (a PlacedKv: its blocks, which the request adopted, hold the KV)
        return self.runner.launch_mixed_ahead(launched, rows, batch)

    def _book(self, launched: StepLaunch) -> None:
        """Count `launched`'s live rows as computed, once: when its tokens are read, or before, when a step is
        scheduled ahead of it (`booked`)."""
        if not launched.booked:
            for request, n in launched.scheduled:
                if self._live(request):
                    request.num_computed_tokens += n
            launched.booked = True

    @staticmethod
    def _plain(request: Request) -> bool:
        """Nothing in its next step depends on the host's reading of the step before: no grammar, choices to fork,
        images or prompt logprobs."""
        return not request.forks and request.grammar is None and request.mm is None \
            and request.sampling.prompt_logprobs is None

    @classmethod
    def _plain_context(cls, request: Request) -> bool:
        return request.request_type is RequestType.CONTEXT_ONLY and cls._plain(request)

    @staticmethod
    def _joins_ahead(request: Request) -> bool:
        """A request that can join a step launched ahead as one more decode row: a handed-off prompt whose KV is
        already in our blocks (a cuda_ipc pull) and its first token, nothing to prefill, copy, fork or mask. A
        decode worker's new requests are these, so they join the next step launched instead of stopping the
        pipeline (which costs them, and every running row, a step and the host's scheduling)."""
        return (request.request_type is RequestType.GENERATION_ONLY and isinstance(request.kv_import, PlacedKv)
                and request.num_tokens == request.num_prompt_tokens + 1 and request.num_preemptions == 0
                and not request.forks and request.grammar is None and request.mm is None)

    def _admit_joiners(self, budget_used: int) -> list[Request]:
        batch = self.scheduler.admit_waiting(self.scheduler.max_num_batched_tokens - budget_used, self._joins_ahead)
        for request in batch.kv_imports:
            request.kv_import = None  # (a PlacedKv: its blocks, which the request adopted, hold the KV)
        return batch.requests

    def _append_token(self, request: Request, token: int, logprob: TokenLogprob | None,
                      read_at: float) -> RequestOutput:
        request.output_token_ids.append(token)
        reason = self._stop_rules[request.request_id].check(token, request.num_tokens)
        if reason is None and request.grammar is not None and request.grammar.ends_with(token):
            reason = FinishReason.STOP
        output = RequestOutput(
            request_id=request.output_id, new_token_ids=[token], new_logprobs=[logprob] if logprob else [],
            num_prompt_tokens=request.num_prompt_tokens, index=request.index,
            num_cached_tokens=request.num_cached_tokens, num_output_tokens=len(request.output_token_ids),
        )
        if request.first_token_time is None:
            request.first_token_time = read_at
            output.first_scheduled_time, output.first_token_time = request.first_scheduled_time, read_at
            if request.sampling.prompt_logprobs is not None and not request.group_id \
                    and request.request_type is not RequestType.GENERATION_ONLY:
                output.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, []
        if request.request_type is RequestType.CONTEXT_ONLY:
            # With several choices the leader's session serves those its first token did not end.
            if request.group_id:
                reason = FinishReason.CONTEXT_DONE
                self._finish(request, reason)
            elif reason is None or request.request_id in self._groups:
                session = self._pin_session(request, token)
                output.session_id, output.session = session.session_id, dataclasses.replace(session)
                reason = FinishReason.CONTEXT_DONE
        if reason is not None:
            output.finished, output.finish_reason = True, reason
            if reason is not FinishReason.CONTEXT_DONE:
                self._finish(request, reason)
        return output

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.remove(request)
        if request.block_table:
            self.block_manager.store_finished(request)  # (write-through tiers: the node's other workers find them)
            self.block_manager.free(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        self._forget(request)

    def _forget(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        self._stop_rules.pop(request.request_id, None)
        group = self._groups.get(request.output_id)
        if group is not None and not any(self._live(m) for m in group):
            del self._groups[request.output_id]

    # --- KV sessions (context_only → generation_only handoff) ---

    def _pin_session(self, request: Request, first_token: int) -> KvSession:
        """The session takes over the request's blocks; they stay out of the free pool until released."""
        session = self.sessions.create(request.request_id, request.block_table, request.num_prompt_tokens,
                                       first_token, request.block_hashes)
        with self.block_manager.lock:  # the fence of one-sided reads (common.kv.fence), where the exporter keeps one
            epochs = self.block_manager.epochs
            session.epoch = epochs.total(session.block_ids) if epochs is not None else None
        self.scheduler.remove(request)
        request.block_table = []
        request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.CONTEXT_DONE
        self._forget(request)
        return session

    def export_session(self, session_id: str) -> KvExport:
        session = self.sessions.get(session_id)
        return KvExport(self.kv_layout, session.num_tokens, self.runner.export_blocks(session.block_ids))

    @property
    def kv_cache(self):
        """The whole paged cache tensor [layers, 2, blocks, block_size, kv_heads, head_dim], for the KV data plane."""
        return self.runner.kv_cache

    def kv_blocks(self) -> KvBlocks:
        return self.block_manager.kv_blocks(self.kv_cache)

    # Leases and releases are called from any thread (TensorStore's, never waiting for a step): the session
    # table's lock guards the sessions, the block manager's lock the pool. A session's blocks are written by no
    # step in flight (a context_only row is never launched ahead), so they may go back to the pool mid-step.

    def lease_session(self, session_id: str, block_ids: list[int] | None = None) -> list[int]:
        """Start an export: the session's blocks (or `block_ids`, a subset) stay pinned, also through a
        release or the TTL, until `end_lease`; the gather itself runs off the engine thread."""
        return self.sessions.lease(session_id, block_ids or ())

    def end_lease(self, session_id: str) -> None:
        self._free(self.sessions.end_lease(session_id))

    def release_session(self, session_id: str) -> None:
        self._free(self.sessions.release(session_id))  # nothing while an export still reads: end_lease frees them

    def release_session_if_held(self, session_id: str) -> bool:
        try:
            self.release_session(session_id)
        except NotFound:
            return False
        return True

    def release_sessions_of(self, request_id: str | None) -> int:
        """Release the sessions one request made (None: every session, at shutdown)."""
        return sum(self.release_session_if_held(session_id) for session_id in self.sessions.ids_of(request_id))

    def _free(self, block_ids: list[int]) -> None:
        if block_ids:
            self.block_manager.free_block_ids(block_ids)

    def load_snapshot(self) -> EngineLoad:
        blocks, (num_sessions, session_blocks) = self.block_manager, self.sessions.held()
        return EngineLoad(
            running=self.num_running, waiting=self.num_waiting, kv_blocks_total=blocks.num_blocks,
            kv_blocks_free=blocks.num_free_blocks, kv_usage_ratio=blocks.usage, active_sessions=num_sessions,
            expired_sessions=self.sessions.num_expired,
            session_bytes=session_blocks * self.kv_layout.block_bytes(),
            prompt_tokens_to_compute=self.prompt_tokens_to_compute(), preemptions=self.num_preemptions)

    def prompt_tokens_to_compute(self) -> int:
        """EngineLoad.prompt_tokens_to_compute. Read from any thread: the queues are copied first (one C call each,
        under the GIL), and a count read mid-step is at most a step old."""
        requests = (*tuple(self.scheduler.waiting), *tuple(self.scheduler.running))
        return sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in requests if r.kv_import is None)

    @property
    def num_leased_released(self) -> int:
        return self.sessions.num_released_leased

    def expire_sessions(self) -> int:
        expired = self.sessions.pop_expired()
        for session in expired:
            log.info("KV session %s of request %s expired unpulled", session.session_id, session.request_id)
            self._free(session.block_ids)
        return len(expired)

    def close(self) -> None:
        """Stop what runs beside this engine (a tensor-parallel engine's follower ranks)."""
        self.runner.close()
        self.grammars.close()
        if self.speculator is not None:
            self.speculator.close()
        if self.kv_tiers is not None:
            self.kv_tiers.close()

    # --- convenience for scripts and tests ---

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | None = None) -> list[list[int]]:
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, sampling)
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                outputs[out.request_id].extend(out.new_token_ids)
        return [outputs[rid] for rid in ids]

"""Turns a ScheduledBatch into tensors, runs the model on the paged cache, and samples.

Under tensor parallelism rank 0's runner turns each batch into `StepInputs` and sends them to the follower
ranks (tp_ranks.py), and every rank runs `run_step` on them: the same forward, on its share of the weights
and its heads of the cache, meeting the others in the model's collectives. Only rank 0 samples.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass

import torch

from common.engine.attention import BatchLayout, TorchPagedAttention
from common.engine.config import EngineConfig, kv_cache_blocks, resolve_max_model_len
from common.cpu_cores import pin_model_thread, usable_cores
from common.engine import cpu_attention, cpu_ops
from common.engine.cpu_linear import pack_linears, packs
from common.devices import bind_thread, limit_host_threads
from common.engine.greedy import greedy_tokens
from common.engine.models.loader import check_shardable, load_model
from common.engine.parallel import SINGLE, TensorParallel, check_devices, rank_device
from common.engine.quantization.kv_cache import KvCacheFormat
from common.kv.words import as_words
from common.engine.shared_cache import SharedKvCache
from common.engine.tp_ranks import FollowerRanks
from common.engine.grammar_backend import GrammarState
from common.engine.host_upload import upload
from common.engine.request import Request, TokenLogprob
from common.engine.sampler import Sampler, logprobs_on_device, with_logprobs
from common.engine.scheduler import ScheduledBatch
from common.engine.spec.memory import proposer_memory
from common.kv import ipc_share
from common.kv.blocks import gather_blocks
from common.kv.layout import KvExport, KvLayout
from common.kv.shards import KvShards
from common.pb.disagg.v1 import worker_pb2

log = logging.getLogger(__name__)


def _drawn_on_device(request: Request, one_rank: bool) -> bool:
    """A row whose token the device draws, so that it may stay there (its logprobs computed there too): no penalty
    or bias (they count the tokens before, which a step launched ahead has not read yet). Greedy with a
    grammar, or sampled (temperature > 0, no grammar), only on one rank: each follower feeds its own argmax,
    unmasked, to a step launched ahead, which would not be what rank 0 masked or drew."""
    s = request.sampling
    if s.adjusts_logits:
        return False
    return one_rank or (s.greedy and request.grammar is None)


def _step_tokens(request: Request, n: int) -> list[int]:
    """The `n` tokens a step computes for `request`, from its computed count on; a decode's one without copying the
    whole sequence."""
    start = request.num_computed_tokens
    if start == request.num_tokens - 1:  # a decode row, and its drafts if it speculates (n - 1 of them)
        return [(request.output_token_ids or request.prompt_token_ids)[-1], *request.draft_token_ids[: n - 1]]
    return request.all_token_ids[start : start + n]


def _prompt_rows(request: Request, start: int, n: int) -> range:
    """Positions of this chunk whose logits score the next prompt token (prompt_logprobs asked for)."""
    if request.sampling.prompt_logprobs is None or request.output_token_ids or request.group_id:
        return range(0)  # not asked for, sent with the first token (or prefill's), or another choice's (the leader's)
    return range(start, min(start + n, request.num_prompt_tokens - 1))


def _image_rows(batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows of the packed batch, their image embeddings) over the placeholders this step covers; None without
    images. A chunk (or a prefix-cache hit) may cover any part of an image."""
    if all(r.mm is None for r in batch.requests):
        return None
    rows, values, row = [], [], 0
    for request, n in zip(batch.requests, batch.num_new_tokens):
        if request.mm is not None:
            offsets, embeddings = request.mm.rows_in(request.num_computed_tokens, request.num_computed_tokens + n)
            rows.append(row + offsets)
            values.append(embeddings)
        row += n
    return torch.cat(rows), torch.cat(values)


def make_attention_backend(block_size: int, windows: set[int | None], device: torch.device,
                           kv: KvCacheFormat | None = None):
    """Triton kernels on a CUDA device when triton is installed and they take the cache (`kv`: an FP8 one where
    Triton has FP8, KvCacheFormat.triton_reads); the torch reference everywhere else."""
    if device.type == "cuda" and (kv is None or kv.triton_reads(device)):
        try:
            from common.engine.attention_triton import TritonPagedAttention
        except ImportError:
            return TorchPagedAttention(block_size, windows, device, kv)
        return TritonPagedAttention(block_size, windows, device)
    return TorchPagedAttention(block_size, windows, device, kv)


@dataclass
class StepInputs:
    """What every rank needs to run one forward pass: the packed tokens, their positions, the batch layout,
    the rows whose logits are sampled, and image embedding rows (row indices, rows) spliced over placeholders."""

    input_ids: list[int] | None
    positions: list[int]
    layout: BatchLayout
    sample_rows: list[int]
    image_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    graphed: bool = False  # rank 0 replays a decode graph: every rank replays the same one
    # Launched ahead: the tokens are these rows of the previous step's greedy ones, which every rank holds on its
    # device, then input_ids (the tokens of rows that joined that step).
    ahead_rows: list[int] | None = None


@dataclass
class StepLaunch:
    """One forward pass on its way. `scheduled`: every (request, new tokens) of the step; `sampled`: the rows
    that sample, in order. With every sampled row's token drawn on the device (_drawn_on_device), `tokens` [B] stay
    there (valid until the next step runs; a step launched ahead reads them on the same stream) and `result` waits for
    their copy to the host; otherwise the sampler already ran and `result` returns what it drew. A step launched
    ahead with grammar rows keeps its `logits` unsampled instead: their masks need the step before's tokens
    accepted, so the engine books those first and then calls ModelRunner.sample_masked, while this forward runs."""

    scheduled: list[tuple[Request, int]]
    sampled: list[Request]
    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    drawn: list[tuple[int, TokenLogprob | None]] | None = None
    logits: torch.Tensor | None = None
    # Rows that asked for logprobs: (their indices in `sampled`, each one's top_logprobs), and the values
    # (sampler.logprobs_on_device) copied to the host behind the same event as the tokens.
    logprob_rows: tuple[list[int], list[int]] | None = None
    logprob_host: torch.Tensor | None = None
    # The host waits for no token of it (no row samples), so its result does not mean the GPU ran it.
    unawaited: bool = False
    # Its rows' computed counts were advanced before it ran (the engine launched the next prompt step first).
    booked: bool = False

    @property
    def awaits_masks(self) -> bool:
        return self.logits is not None

    def result(self) -> list[tuple[int, TokenLogprob | None]]:
        """(token, logprob) of each sampled row; waits for the GPU when the tokens are still on their way."""
        if self.drawn is None:
            if self.ready is not None:
                self.ready.synchronize()
            rows, tops = self.logprob_rows or ([], [])
            packed = None if self.logprob_host is None else self.logprob_host.tolist()
            self.drawn = with_logprobs(self.host.tolist(), rows, tops, packed)
        return self.drawn


def _score_prompts(scored: list[tuple[Request, range]], logits: torch.Tensor) -> None:
    """Each scored position's logits give the next prompt token's logprob (and the top k asked for): appended to
    the request's prompt_logprobs, in one host copy per step."""
    targets = [r.prompt_token_ids[p + 1] for r, positions in scored for p in positions]
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
    k = max(r.sampling.prompt_logprobs for r, _ in scored)
    top = torch.topk(lp, k) if k else None
    values, ids = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
    row = 0
    for request, positions in scored:
        if positions.start == 0:
            request.prompt_logprobs = []  # a recompute from the start (a preemption) scores again
        want = request.sampling.prompt_logprobs
        for _ in positions:
            tops = list(zip(ids[row][:want], values[row][:want])) if want else []
            request.prompt_logprobs.append(TokenLogprob(targets[row], chosen[row], tops))
            row += 1


class ModelRunner:
    """Rank 0's runner (the engine's), or with `tp` and `kv_cache` a follower rank's (tp_follower.py)."""

    def __init__(self, config: EngineConfig, seed: int = 0, tp: TensorParallel | None = None,
                 kv_cache: torch.Tensor | None = None):
        self.dtype = config.torch_dtype
        self.kv_format = KvCacheFormat.of(config.kv_cache_dtype, self.dtype)
        self.kv_dtype = self.kv_format.dtype  # what the cache holds (and the handoff moves)
        self.block_size = config.block_size
        self.ranks = None
        if tp is None and config.tensor_parallel_size > 1:
            check_shardable(config.model, config.tensor_parallel_size)  # before a rank starts: one clear error
            check_devices(config.device, config.tensor_parallel_size)
            self.ranks = FollowerRanks(config)
        self.tp = self.ranks.tp if self.ranks is not None else tp or SINGLE
        self.device = rank_device(config.device, self.tp.rank)
        bind_thread(self.device)  # the loading thread's kernels (and a graph's capture) go to this rank's GPU
        if self.tp.size > 1 and self.device.type == "cpu":  # the ranks share the cores this process may use
            torch.set_num_threads(max(1, len(usable_cores()) // self.tp.size))
        self.model, self.hf_config = load_model(config.model, self.dtype, self.device, self.tp, config.load_format,
                                                config.dummy_seed, config.quantization)
        limit_host_threads(self.device)  # after loading, which may convert weights on the host's whole pool
        if packs(self.device, self.dtype):  # bf16 GEMMs on the CPU's own instructions, weights packed once
            pack_linears(self.model)
        c = self.hf_config
        shape = self.model.kv_shape()
        self.num_layers, self.num_kv_heads, self.head_dim = shape.num_layers, shape.num_kv_heads, shape.head_dim
        heads = self.num_kv_heads // self.tp.size
        block_bytes = 2 * self.num_layers * self.block_size * heads * self.head_dim * self.kv_dtype.itemsize
        proposer = (proposer_memory(config.speculative_config, (getattr(c, "text_config", None) or c).hidden_size,
                                    self.dtype, self.block_size, config.max_num_seqs)  # a draft's share of the GPU
                    if config.memory_share is not None else None)
        self.num_kv_blocks = kv_cache_blocks(config, c, block_bytes, proposer)  # after the weights: they count as used
        if self.tp.size > 1 and self.device.type == "cuda":
            # A cache of its own heads on each rank's GPU; rank 0 maps the others' (kv_cache: every head).
            self.num_kv_blocks = self.tp.min(self.num_kv_blocks)
            self.rank_cache = torch.zeros((self.num_layers, 2, self.num_kv_blocks, self.block_size, heads,
                                           self.head_dim), dtype=self.kv_dtype, device=self.device)
            self.kv_cache = self._map_rank_caches()
        else:
            # Every KV head (what the KV data plane and the handoff see); rank_cache: the heads this rank computes.
            cache_shape = (self.num_layers, 2, self.num_kv_blocks, self.block_size, self.num_kv_heads, self.head_dim)
            self.kv_cache = kv_cache if kv_cache is not None else self._make_cache(cache_shape)
            self.rank_cache = self.kv_cache[..., self.tp.rank * heads:(self.tp.rank + 1) * heads, :] \
                if self.tp.size > 1 else self.kv_cache
        self.attention = make_attention_backend(self.block_size, set(shape.windows), self.device, self.kv_format)
        if self.device.type == "cpu":
            cpu_attention.kernel()  # built (once per machine) or loaded now, not in the first request's step
            if self.dtype == torch.bfloat16:
                cpu_ops.warm()  # the same for the bf16 norm / RoPE kernels
        self.sampler = Sampler(seed)
        self.graphs = self._make_graphs(config)
        self.prefill_graphs = self._make_prefill_graphs(config)
        self._greedy: torch.Tensor | None = None  # a follower's: its last step's greedy tokens (the next ahead's input)
        self._stepping_thread: int | None = None  # the thread pinned to the model's cores (the engine loop's)
        # EAGLE-3 (spec/eagle3.py): told after each forward each (request, first position, tokens) of the step and
        # the model's aux_hidden over them; None: nothing reads the target's hidden states.
        self.hidden_sink = None

    def bind(self) -> None:
        """Make this runner's GPU the calling thread's current device. A graph replays, and a copy or kernel
        launches, on the current device's stream: an engine stepped from a thread another engine's GPU is current
        on (two engines in one process) would otherwise run unordered with its own uploads, and read them early."""
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)

    def _make_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.ranks is None:
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        shared = SharedKvCache.create(shape, self.kv_dtype)
        try:
            self.ranks.send(shared)
            cache = shared.open()
            self.tp.all_reduce(torch.zeros(1))  # every follower has mapped it and loaded its weights
        finally:
            shared.unlink()
        return cache

    def _map_rank_caches(self) -> torch.Tensor | KvShards:
        """GPUs: each follower shares its cache through CUDA IPC at the rendezvous; rank 0 maps them all, and the KV
        data plane sees the shards as one cache."""
        if self.tp.rank:
            share = ipc_share.share_cache(self.rank_cache, f"tp-rank-{self.tp.rank}")
            self.tp.store.set(f"kv-cache-{self.tp.rank}", share.SerializeToString())
            return self.rank_cache
        shards, owner_shares = [self.rank_cache], [None]
        for rank in range(1, self.tp.size):
            share = worker_pb2.KvCacheShare.FromString(self.tp.store.get(f"kv-cache-{rank}"))
            shards.append(ipc_share.open_cache(share))
            owner_shares.append(share.payload)  # what importers open: the follower's own handle
        return KvShards(shards, owner_shares)

    def close(self) -> None:
        """Stop the follower ranks (a runner without them has nothing to stop) and drop the mappings of their
        caches. Every rank leaves the NCCL group together first (TensorParallel.leave)."""
        if self.ranks is not None:
            self.ranks.close()
            if isinstance(self.kv_cache, KvShards):
                self.kv_cache = self.rank_cache

    def _make_graphs(self, config: EngineConfig):
        """CUDA graphs for decode steps, when the GPU attention backend runs and eager mode is not forced."""
        if config.enforce_eager or self.device.type != "cuda" or not self.attention.graphable:
            return None
        spec = config.speculative_config
        if spec is not None and spec.reads_target_hidden:
            # The graphs capture the forward that keeps the layers the head reads, and hand them out after each replay.
            from common.engine.spec.eagle3_head import head_aux_layers

            self.model.aux_layers = head_aux_layers(spec.model, self.hf_config.num_hidden_layers)
        from common.engine.cuda_graphs import DecodeGraphs

        max_len = resolve_max_model_len(config, self.hf_config.max_position_embeddings)
        return DecodeGraphs(self.model, self.attention, self.rank_cache, config.max_num_seqs,
                            -(-max_len // self.block_size), self.device)

    def _make_prefill_graphs(self, config: EngineConfig):
        """Whole-step CUDA graphs for the other steps (common.engine.prefill_graphs), with the decode graphs, on one
        rank. A model whose forward does not capture runs those steps eagerly, said once here."""
        if self.graphs is None or self.tp.size > 1:
            return None
        from common.engine.prefill_graphs import PrefillGraphs

        try:
            return PrefillGraphs(self.model, self.attention, self.rank_cache, config.max_num_batched_tokens,
                                 config.max_num_seqs, self.graphs.tables.shape[1], self.device)
        except Exception as exc:  # a capture the model refuses: eager prompt steps, never a failed start
            log.warning("prompt and mixed steps run eagerly (no whole-step CUDA graphs): %s: %s",
                        type(exc).__name__, exc)
            torch.cuda.synchronize(self.device)
            return None

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> StepLaunch:
        """Start one forward pass over a scheduled batch. Its greedy tokens stay on the device until read
        (`StepLaunch.result`), so a next decode step can be launched first (`launch_ahead`)."""
        input_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        sampled: list[Request] = []
        scored: list[tuple[Request, range]] = []  # prompt positions whose logprobs are asked for
        score_rows: list[int] = []
        draws: list[int] = []  # each sampled row's output position, where a row drafts (seeded draws)
        for request, n in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens
            input_ids.extend(_step_tokens(request, n))
            if positions_scored := _prompt_rows(request, start, n):
                scored.append((request, positions_scored))
                score_rows.extend(len(input_ids) - n + p - start for p in positions_scored)
            positions.extend(range(start, start + n))
            if n > 1 and start == request.num_tokens - 1:  # a decode row with drafts: every position samples
                last_rows.extend(range(len(input_ids) - n, len(input_ids)))
                sampled += [request] * n
                draws.extend(range(len(request.output_token_ids), len(request.output_token_ids) + n))
            elif start + n == request.num_tokens:  # a finished prefill chunk or a decode: sample
                last_rows.append(len(input_ids) - 1)
                sampled.append(request)
                draws.append(len(request.output_token_ids))
                if not request.output_token_ids:  # its prompt is done: choices waiting on it sample the same row
                    waiting = [c for c in request.forks if not c.output_token_ids]
                    last_rows += [len(input_ids) - 1] * len(waiting)
                    sampled += waiting
                    draws += [0] * len(waiting)
        layout = BatchLayout(
            query_lens=list(batch.num_new_tokens),
            context_lens=[r.num_computed_tokens for r in batch.requests],
            block_tables=[r.block_table for r in batch.requests],
        )
        scheduled = list(zip(batch.requests, batch.num_new_tokens))
        plain = not scored and len(set(last_rows)) == len(last_rows)  # no prompt scored, no choice forking
        if self._graphed(layout, batch.requests) and plain:
            self._send(StepInputs(input_ids, positions, layout, last_rows, graphed=True))
            return self._sample(scheduled, sampled, *self.graphs.run(input_ids, positions, layout))
        logits = self.run_step(StepInputs(input_ids, positions, layout, last_rows + score_rows, _image_rows(batch)))
        self._hand_hidden(batch.requests, layout.context_lens, batch.num_new_tokens)
        if scored:  # rows after the sampled ones: prompt positions
            _score_prompts(scored, logits[len(last_rows):])
            logits = logits[: len(last_rows)]
        if not sampled:
            return StepLaunch(scheduled, [], drawn=[], unawaited=self.device.type == "cuda")
        if len(draws) > len(set(map(id, sampled))):  # drafts: the sampler draws each position at its own place
            return StepLaunch(scheduled, sampled, drawn=self.sampler(logits, sampled, draws))
        return self._sample(scheduled, sampled, logits, None)

    def _send(self, step: StepInputs) -> None:
        if self.ranks is not None:
            self.ranks.send(step)

    @torch.inference_mode()
    def run_step(self, step: StepInputs, ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """One forward pass on this rank (rank 0 first hands it to the followers): the logits of the sampled
        rows, None when no row samples. `ids`: the tokens on the device, for a step launched ahead."""
        if self._stepping_thread != threading.get_ident():  # the thread that steps runs on the model's cores, if any
            self._stepping_thread = threading.get_ident()
            pin_model_thread()
        self._send(step)
        uploaded = upload([step.positions, step.sample_rows] + ([step.input_ids] if ids is None else []), self.device)
        positions, sample_rows = uploaded[:2]
        ids = uploaded[2] if ids is None else ids
        embeds = None
        if step.image_rows is not None:
            embeds = self.model.embed(ids)
            rows, values = step.image_rows
            embeds[rows.to(self.device)] = values.to(device=self.device, dtype=embeds.dtype)
        if self.prefill_graphs is not None and embeds is None and self.prefill_graphs.fits(step.layout):
            hidden = self.prefill_graphs.run(ids, positions, step.layout)
        else:
            hidden = self.model(ids, positions, self.rank_cache, self.attention.prepare(step.layout), self.attention,
                                embeds)
        if not step.sample_rows:
            return None
        return self.model.compute_logits(hidden[sample_rows])

    @torch.inference_mode()
    def launch_ahead(self, prev: StepLaunch, rows: list[int], joined: list[Request] = ()) -> StepLaunch:
        """The decode step after `prev`, launched before prev's tokens are read: each of prev.sampled[rows] feeds
        the token prev sampled for it (still on the device) at its next position. Their block tables must
        already hold that position; prev must have device tokens (every row drawn on the device). Grammar rows
        leave it awaiting its masks (sample_masked). `joined`: decode rows that were not in prev (a handed-off
        prompt's first token, known on the host), after the others."""
        requests = [prev.sampled[i] for i in rows] + list(joined)
        # prev writes up to num_tokens - 1, this step writes num_tokens; a joined row writes its last token's KV
        ctx = [r.num_tokens for r in requests[: len(rows)]] + [r.num_computed_tokens for r in joined]
        layout = BatchLayout(query_lens=[1] * len(requests), context_lens=ctx,
                             block_tables=[r.block_table for r in requests])
        joined_ids = [r.output_token_ids[-1] for r in joined]
        ids = self._ahead_ids(prev.tokens, rows, joined_ids)
        scheduled = [(r, 1) for r in requests]
        # The followers feed their own copy of prev's greedy tokens (every rank holds the same logits), then the
        # joined rows' tokens (input_ids).
        step = StepInputs(joined_ids, ctx, layout, list(range(len(requests))), ahead_rows=rows)
        if self._graphed(layout, requests):
            self._send(dataclasses.replace(step, graphed=True))
            return self._sample(scheduled, requests, *self.graphs.run(ids, ctx, layout), grammars_current=False,
                                pending=len(rows))
        logits = self.run_step(step, ids)
        self._hand_hidden(requests, ctx, [1] * len(requests))
        return self._sample(scheduled, requests, logits, None, grammars_current=False, pending=len(rows))

    @torch.inference_mode()
    def launch_mixed_ahead(self, prev: StepLaunch, rows: list[int], batch: ScheduledBatch) -> StepLaunch:
        """A mixed step launched before prev's tokens are read: each of prev.sampled[rows] feeds the token prev
        sampled for it (on the device) at its next position, first, then `batch`'s prompt tokens (known here). Every
        request counts as computed up to where this step starts (prev booked), and holds blocks for its tokens."""
        decodes = [prev.sampled[i] for i in rows]
        host_ids: list[int] = []
        positions = [r.num_computed_tokens for r in decodes]
        last_rows, sampled = list(range(len(rows))), list(decodes)
        for request, n in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens
            host_ids.extend(_step_tokens(request, n))  # (n == 1: a handed-off prompt's first token, or a decode)
            positions.extend(range(start, start + n))
            if start + n == request.num_tokens:
                last_rows.append(len(positions) - 1)
                sampled.append(request)
        requests = decodes + batch.requests
        layout = BatchLayout(query_lens=[1] * len(rows) + list(batch.num_new_tokens),
                             context_lens=[r.num_computed_tokens for r in requests],
                             block_tables=[r.block_table for r in requests])
        scheduled = [(r, 1) for r in decodes] + list(zip(batch.requests, batch.num_new_tokens))
        step = StepInputs(host_ids, positions, layout, last_rows, ahead_rows=rows)  # (followers: as launch_ahead's)
        logits = self.run_step(step, self._ahead_ids(prev.tokens, rows, host_ids))
        self._hand_hidden(requests, layout.context_lens, layout.query_lens)
        return self._sample(scheduled, sampled, logits, None, grammars_current=False, pending=len(rows))

    def _hand_hidden(self, requests: list[Request], starts: list[int], counts: list[int]) -> None:
        if self.hidden_sink is not None:
            self.hidden_sink(list(zip(requests, starts, counts)), self.model.aux_hidden)

    def _ahead_ids(self, tokens: torch.Tensor, rows: list[int], joined_ids: list[int]) -> torch.Tensor:
        """A step launched ahead's input tokens: prev's greedy tokens of `rows` (on the device), then the joined
        rows' tokens."""
        ids = tokens if len(rows) == len(tokens) else tokens.index_select(0, self._upload(rows))
        return torch.cat([ids, self._upload(joined_ids)]) if joined_ids else ids

    @torch.inference_mode()
    def follow(self, step: StepInputs) -> None:
        """A follower rank's share of a step rank 0 launched: the same forward (a graph replay where rank 0's was),
        keeping the greedy tokens a step launched ahead feeds next."""
        ids = None if step.ahead_rows is None else self._ahead_ids(self._greedy, step.ahead_rows, step.input_ids)
        if step.graphed:
            _, self._greedy = self.graphs.run(step.input_ids if ids is None else ids, step.positions, step.layout)
            return
        logits = self.run_step(step, ids)
        if logits is not None:
            self._greedy = greedy_tokens(logits)

    def _graphed(self, layout: BatchLayout, requests: list[Request]) -> bool:
        return self.graphs is not None and self.graphs.fits(layout) and all(r.mm is None for r in requests)

    def _upload(self, values: list[int]) -> torch.Tensor:
        """A small int64 tensor on the device without a host sync (pinned staging, non-blocking copy)."""
        return upload([values], self.device)[0]

    def _sample(self, scheduled: list[tuple[Request, int]], sampled: list[Request], logits: torch.Tensor,
                argmax: torch.Tensor | None, grammars_current: bool = True, pending: int = 0) -> StepLaunch:
        """Rows the device draws (_drawn_on_device): the tokens stay there, copied to pinned memory behind an event,
        grammar rows masked first (or, not `grammars_current`, left for sample_masked, greedy rows only). Otherwise
        the sampler runs now (it reads the tokens on the host). `pending`: the leading rows whose token from the step
        before is not booked yet (a step launched ahead): each draws one output position further."""
        def draws() -> list[int]:  # each row's output position (seeded draws), for the steps that sample
            return [len(r.output_token_ids) + (i < pending) for i, r in enumerate(sampled)]
        grammar = any(r.grammar is not None for r in sampled)
        greedy = all(r.sampling.greedy for r in sampled)
        want = [i for i, r in enumerate(sampled) if r.sampling.logprobs]
        if not all(_drawn_on_device(r, self.ranks is None) for r in sampled) or (grammar and (want or not greedy)):
            # (a grammar masks the logits in place: logprobs, of the raw ones, are the sampler's to copy first)
            return StepLaunch(scheduled, sampled, drawn=self.sampler(logits, sampled, draws()))
        launch = StepLaunch(scheduled, sampled)
        if grammar:
            if not grammars_current:
                launch.logits = logits
                return launch
            self.sampler.masks.apply(logits, [r.grammar for r in sampled])
            argmax = None  # (a graph's is of the unmasked logits)
        if not greedy:
            tokens = self.sampler.draw(logits, sampled, draws())
        else:
            tokens = argmax if argmax is not None else greedy_tokens(logits)
        if want:
            launch.logprob_rows = want, [sampled[i].sampling.top_logprobs for i in want]
            self._device_tokens(launch, tokens, logprobs_on_device(logits, want, tokens, launch.logprob_rows[1]))
        else:
            self._device_tokens(launch, tokens)
        return launch

    @torch.inference_mode()
    def sample_masked(self, launch: StepLaunch, grammars: list[GrammarState | None]) -> None:
        """Sample a step launched ahead that awaits its grammar masks, once every grammar in `grammars` (one a
        sampled row; None: unmasked, such as a row that ended since) took the tokens before. On a GPU the masks are
        filled while its forward runs, and its tokens stay on the device as a plain greedy step's do."""
        logits, launch.logits = launch.logits, None
        self._device_tokens(launch, self.sampler.masks.greedy(logits, grammars))  # the sampler's greedy rule

    def _device_tokens(self, launch: StepLaunch, tokens: torch.Tensor, logprobs: torch.Tensor | None = None) -> None:
        """The step's tokens (and its rows' packed logprobs) on their way to the host behind one event."""
        if self.device.type != "cuda":
            launch.tokens = launch.host = tokens
            launch.logprob_host = logprobs
            return
        # Pinned from torch's caching host allocator, which holds each buffer until its copy has run.
        launch.host, launch.logprob_host = (None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                            for t in (tokens, logprobs))
        launch.host.copy_(tokens, non_blocking=True)
        if logprobs is not None:
            launch.logprob_host.copy_(logprobs, non_blocking=True)
        launch.ready = torch.cuda.Event()
        launch.ready.record()
        launch.tokens = tokens

    # --- KV export / import: whole blocks with their layout ---

    def layout(self, fingerprint: str) -> KvLayout:
        return KvLayout(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            block_size=self.block_size, dtype=str(self.kv_dtype).removeprefix("torch."), fingerprint=fingerprint,
        )

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim], on the CPU (in-process
        handoffs; the services' exports go through common.kv.gather off the engine thread)."""
        return gather_blocks(self.kv_cache, block_ids).cpu()

    def import_blocks(self, block_ids: list[int], kv: KvExport) -> None:
        """Scatter imported blocks into ours; the KV plane already put them on this device (a side stream)."""
        blocks = kv.blocks.to(device=self.device, dtype=self.kv_dtype)
        if blocks.is_cuda:  # allocated on the plane's stream: keep it alive until this stream's scatter ran
            blocks.record_stream(torch.cuda.current_stream(blocks.device))
        ids = block_ids[: blocks.shape[2]]
        if isinstance(self.kv_cache, KvShards):
            self.kv_cache.scatter(ids, blocks)
            for device in self.kv_cache.devices()[1:]:  # another process reads them next, on its own stream
                torch.cuda.synchronize(device)
            return
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        if self.kv_format.is_fp8:  # torch has no index_copy_ of float8: the same bytes as integers
            as_words(self.kv_cache).index_copy_(2, index, as_words(blocks))
        else:
            self.kv_cache.index_copy_(2, index, blocks)

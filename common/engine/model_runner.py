"""Turns a ScheduledBatch into tensors, runs the model on the paged cache, and samples."""
from __future__ import annotations

import torch

from common.engine.attention import BatchLayout, make_attention_backend
from common.engine.config import EngineConfig, kv_cache_blocks, resolve_max_model_len
from common.engine.models.llama import head_dim_of, sliding_windows
from common.engine.models.loader import load_model
from common.engine.request import Request, TokenLogprob
from common.engine.sampler import Sampler
from common.engine.scheduler import ScheduledBatch
from common.kv.gather import gather_blocks
from common.kv.layout import KvExport, KvLayout


class ModelRunner:
    def __init__(self, config: EngineConfig, seed: int = 0):
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.model, self.hf_config = load_model(config.model, self.dtype, self.device)
        c = self.hf_config
        self.num_layers = c.num_hidden_layers
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = head_dim_of(c)
        block_bytes = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        self.num_kv_blocks = kv_cache_blocks(config, c, block_bytes)  # after the weights: they count as used
        self.kv_cache = torch.zeros(
            (self.num_layers, 2, self.num_kv_blocks, self.block_size, self.num_kv_heads, self.head_dim),
            dtype=self.dtype, device=self.device,
        )
        self.attention = make_attention_backend(self.block_size, set(sliding_windows(c)), self.device)
        self.sampler = Sampler(seed)
        self.graphs = self._make_graphs(config)

    def _make_graphs(self, config: EngineConfig):
        """CUDA graphs for decode steps, when the GPU attention backend runs and eager mode is not forced."""
        if config.enforce_eager or self.device.type != "cuda" or not hasattr(self.attention, "host_arrays"):
            return None
        from common.engine.cuda_graphs import DecodeGraphs

        max_len = resolve_max_model_len(config, self.hf_config.max_position_embeddings)
        return DecodeGraphs(self.model, self.attention, self.kv_cache, config.max_num_seqs,
                            -(-max_len // self.block_size), self.device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> dict[str, tuple[int, TokenLogprob | None]]:
        """One forward pass; returns the sampled token of each request whose scheduled tokens reach its end."""
        input_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        sampled: list[Request] = []
        for request, n in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens
            if n == 1 and start == request.num_tokens - 1:  # a decode: skip copying the whole sequence
                input_ids.append((request.output_token_ids or request.prompt_token_ids)[-1])
            else:
                input_ids.extend(request.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            if start + n == request.num_tokens:  # a finished prefill chunk or a decode: sample
                last_rows.append(len(input_ids) - 1)
                sampled.append(request)
        layout = BatchLayout(
            query_lens=list(batch.num_new_tokens),
            context_lens=[r.num_computed_tokens for r in batch.requests],
            block_tables=[r.block_table for r in batch.requests],
        )
        if self.graphs is not None and self.graphs.fits(layout) and all(r.mm is None for r in batch.requests):
            logits = self.graphs.run(input_ids, positions, layout)
            return {r.request_id: out for r, out in zip(sampled, self.sampler(logits, sampled))}
        meta = self.attention.prepare(layout)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(
            ids, torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_cache, meta, self.attention, self._splice_images(batch, ids),
        )
        if not sampled:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)])
        return {r.request_id: out for r, out in zip(sampled, self.sampler(logits, sampled))}

    def _splice_images(self, batch: ScheduledBatch, ids: torch.Tensor) -> torch.Tensor | None:
        """Token embeddings with image embedding rows over the placeholders this step covers; None without images."""
        if all(r.mm is None for r in batch.requests):
            return None
        embeds = self.model.model.embed_tokens(ids)
        row = 0
        for request, n in zip(batch.requests, batch.num_new_tokens):
            if request.mm is not None:  # a chunk (or a prefix-cache hit) may cover any part of an image
                offsets, rows = request.mm.rows_in(request.num_computed_tokens, request.num_computed_tokens + n)
                embeds[row + offsets.to(self.device)] = rows.to(device=self.device, dtype=embeds.dtype)
            row += n
        return embeds

    # --- KV export / import: whole blocks with their layout ---

    def layout(self, fingerprint: str) -> KvLayout:
        return KvLayout(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            block_size=self.block_size, dtype=str(self.dtype).removeprefix("torch."), fingerprint=fingerprint,
        )

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim], on the CPU (in-process
        handoffs; the services' exports go through common.kv.gather off the engine thread)."""
        return gather_blocks(self.kv_cache, block_ids).cpu()

    def import_blocks(self, block_ids: list[int], kv: KvExport) -> None:
        """Scatter imported blocks into ours; the KV plane already put them on this device (a side stream)."""
        blocks = kv.blocks.to(device=self.device, dtype=self.dtype)
        if blocks.is_cuda:  # allocated on the plane's stream: keep it alive until this stream's scatter ran
            blocks.record_stream(torch.cuda.current_stream(blocks.device))
        index = torch.tensor(block_ids[: blocks.shape[2]], dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(2, index, blocks)

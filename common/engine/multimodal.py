"""Image embeddings of one request: where they go in the prompt and how they key the prefix cache.

The prompt holds one placeholder token per embedding row; images take the placeholder positions
in order (as HF's masked_scatter does). Blocks covering an image's placeholders mix the image's
content hash into their prefix-cache hash (vLLM's extra_keys), so two different images never
share cached KV and the same image does.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch

from common.errors import InvalidRequest


@dataclass(frozen=True)
class ImageEmbedding:
    embedding: torch.Tensor  # [num_placeholder_tokens, hidden_size]
    content_hash: str


@dataclass(frozen=True)
class ImageSpan:
    positions: list[int]  # prompt positions of this image's placeholders, increasing
    content_hash: str


@dataclass
class MultiModalInputs:
    embeddings: torch.Tensor  # [total placeholders, hidden], row j goes to positions[j]
    positions: torch.Tensor  # [total placeholders] long, increasing
    spans: list[ImageSpan]

    @classmethod
    def build(cls, prompt: list[int], image_token_id: int | None, images: list[ImageEmbedding],
              hidden_size: int) -> "MultiModalInputs":
        """Match the prompt's placeholders with the images; InvalidRequest when the counts disagree."""
        if image_token_id is None:
            raise InvalidRequest("this model takes no images (it has no vision tower)")
        placeholders = [i for i, t in enumerate(prompt) if t == image_token_id]
        rows = [im.embedding.shape[0] for im in images]
        if sum(rows) != len(placeholders):
            raise InvalidRequest(f"the prompt has {len(placeholders)} image placeholder tokens (id {image_token_id}) "
                                 f"but the {len(images)} image embeddings have {sum(rows)} rows {rows}")
        for im in images:
            if im.embedding.dim() != 2 or im.embedding.shape[1] != hidden_size:
                raise InvalidRequest(f"an image embedding has shape {list(im.embedding.shape)}; "
                                     f"expected [tokens, {hidden_size}]")
        spans, start = [], 0
        for im, n in zip(images, rows):
            spans.append(ImageSpan(placeholders[start : start + n], im.content_hash))
            start += n
        return cls(torch.cat([im.embedding for im in images]), torch.tensor(placeholders, dtype=torch.long), spans)

    @classmethod
    def imported(cls, prompt: list[int], image_token_id: int, hidden_size: int) -> "MultiModalInputs":
        """For a prompt whose KV was imported (generation_only): no embeddings, and a key of its own for the
        image blocks, so they never enter the prefix cache under their bare token ids."""
        placeholders = [i for i, t in enumerate(prompt) if t == image_token_id]
        return cls(torch.empty(0, hidden_size), torch.empty(0, dtype=torch.long),
                   [ImageSpan(placeholders, f"imported-{uuid.uuid4().hex}")])

    def block_key(self, start: int, end: int) -> bytes:
        """Extra hash input of the block covering prompt positions [start, end): the images it overlaps."""
        parts = [f"{span.content_hash}@{span.positions[0] - start}" for span in self.spans
                 if span.positions and span.positions[0] < end and span.positions[-1] >= start]
        return ";".join(parts).encode()

    def rows_in(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets within [start, end), embedding rows) of the placeholders in that range of the prompt."""
        lo = int(torch.searchsorted(self.positions, start))
        hi = int(torch.searchsorted(self.positions, end))
        return self.positions[lo:hi] - start, self.embeddings[lo:hi]

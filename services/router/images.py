"""Request path, in prepare.py: image placeholders in the prompt, where the images go and how many tokens each takes.

Like HF's LlavaProcessor, each image marker (`<image>`) becomes `tokens_per_image` placeholder
tokens; a prompt or chat without markers gets one per image in front of its (first user) text.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import InvalidRequest


@dataclass(frozen=True)
class ImageTokens:
    token_id: int
    token: str  # its text, e.g. "<image>"
    tokens_per_image: int

    def mark_text(self, text: str, num_images: int) -> str:
        return text if self.token in text else f"{self.token}\n" * num_images + text

    def mark_messages(self, messages: list[dict[str, str]], num_images: int) -> list[dict[str, str]]:
        if any(self.token in m["content"] for m in messages):
            return messages
        users = [i for i, m in enumerate(messages) if m["role"] == "user"] or [0]
        marked = list(messages)
        marked[users[0]] = {**messages[users[0]], "content": self.mark_text(messages[users[0]]["content"], num_images)}
        return marked

    def expand(self, ids: list[int], num_images: int) -> list[int]:
        """One marker per image → tokens_per_image placeholders each; an already expanded prompt is kept."""
        found = sum(1 for t in ids if t == self.token_id)
        if found == num_images * self.tokens_per_image:
            return ids
        if found != num_images:
            raise InvalidRequest(f"the prompt has {found} image placeholders ({self.token!r}, id {self.token_id}) "
                                 f"for {num_images} images; put one {self.token!r} where each image goes "
                                 f"(or {self.tokens_per_image} placeholder ids per image in token_ids)")
        out: list[int] = []
        for t in ids:
            out.extend([t] * self.tokens_per_image if t == self.token_id else [t])
        return out

"""What to send: random prompts (token ids) with input/output lengths drawn from a distribution,
and when to send them (all at once, or a Poisson process at a given rate)."""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Iterator

_KINDS = ("fixed", "uniform", "normal")


@dataclass(frozen=True)
class LengthDist:
    """`fixed:N`, `uniform:LOW:HIGH` (inclusive) or `normal:MEAN:STD` (rounded, clipped to >= 1); a bare N is fixed."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "LengthDist":
        parts = text.split(":")
        if len(parts) == 1:
            parts = ["fixed", parts[0]]
        kind, *numbers = parts
        need = {"fixed": 1, "uniform": 2, "normal": 2}.get(kind)
        if need is None or len(numbers) != need:
            raise ValueError(f"length distribution {text!r}: expected fixed:N, uniform:LOW:HIGH or normal:MEAN:STD")
        try:
            values = [float(n) for n in numbers]
        except ValueError:
            raise ValueError(f"length distribution {text!r}: numbers expected") from None
        dist = cls(kind, *values)
        dist._check(text)
        return dist

    def _check(self, text: str) -> None:
        if self.kind == "fixed" and self.a < 1:
            raise ValueError(f"length distribution {text!r}: N must be >= 1")
        if self.kind == "uniform" and not 1 <= self.a <= self.b:
            raise ValueError(f"length distribution {text!r}: need 1 <= LOW <= HIGH")
        if self.kind == "normal" and (self.a < 1 or self.b < 0):
            raise ValueError(f"length distribution {text!r}: need MEAN >= 1 and STD >= 0")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    @property
    def mean(self) -> float:
        return {"fixed": self.a, "uniform": (self.a + self.b) / 2, "normal": self.a}[self.kind]

    @property
    def max(self) -> int:
        """An upper bound used to check lengths against the model's context (normal: mean + 4 std)."""
        return int({"fixed": self.a, "uniform": self.b, "normal": self.a + 4 * self.b}[self.kind])

    def __str__(self) -> str:
        return {"fixed": f"fixed:{self.a:g}", "uniform": f"uniform:{self.a:g}:{self.b:g}",
                "normal": f"normal:{self.a:g}:{self.b:g}"}[self.kind]


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    prompt_text: str | None = None  # the ids decoded, for a front door that takes text (KServe's text_input)


def make_requests(n: int, input_len: LengthDist, output_len: LengthDist, token_range: tuple[int, int],
                  seed: int, max_model_len: int | None = None, content_seed: int | None = None) -> list[BenchRequest]:
    """`n` random prompts; each input + output is clipped to `max_model_len` (the output keeps >= 1 token).
    `content_seed` draws other token ids for the same lengths: the same work, but no prefix-cache hits on a
    workload sent before."""
    rng = random.Random(seed)
    ids = rng if content_seed is None else random.Random(f"{seed}/{content_seed}")
    low, high = token_range
    requests = []
    for i in range(n):
        n_in, n_out = input_len.sample(rng), output_len.sample(rng)
        if max_model_len is not None:
            n_in = min(n_in, max_model_len - 1)
            n_out = max(1, min(n_out, max_model_len - n_in))
        requests.append(BenchRequest(i, [ids.randrange(low, high) for _ in range(n_in)], n_out))
    return requests


def arrival_gaps(n: int, request_rate: float, seed: int) -> Iterator[float]:
    """Seconds to wait before each request: 0 for an infinite rate, else exponential gaps (a Poisson process)."""
    rng = random.Random(seed + 1)
    for _ in range(n):
        yield 0.0 if request_rate == float("inf") else rng.expovariate(request_rate)


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Each request's send time after the start: the running sum of the gaps."""
    return list(itertools.accumulate(arrival_gaps(n, request_rate, seed)))

"""One streamed, greedy chat completion over HTTP, each content chunk's arrival timed: what the benches that drive
`disagg up`'s OpenAI door with conversations read (multi_turn.py, spec_decode.py)."""
from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass


@dataclass
class Streamed:
    started: float  # time.perf_counter() as the request was sent
    arrivals: list[float]  # each content chunk's arrival, the same clock
    text: str
    usage: dict

    @property
    def ttft_s(self) -> float:
        return (self.arrivals[0] if self.arrivals else time.perf_counter()) - self.started


def stream_chat(port: int, model: str, messages: list[dict], max_tokens: int, timeout_s: float = 600,
                ignore_eos: bool = False) -> Streamed:
    """`ignore_eos`: every answer runs to `max_tokens` (random weights end their text anywhere, or at once)."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True},
                       **({"ignore_eos": True} if ignore_eos else {})})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    started, arrivals, parts, usage = time.perf_counter(), [], [], {}
    try:
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"chat completion: HTTP {response.status}: {response.read()[:300]!r}")
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    arrivals.append(time.perf_counter())
                    parts.append(delta)
            usage = chunk.get("usage") or usage
    finally:
        connection.close()
    return Streamed(started, arrivals, "".join(parts), usage)

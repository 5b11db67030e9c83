"""TTFT of the first requests a fresh `disagg up` serves against later ones: starts `up` with the arguments given,
reports each worker's ready line, then sends sequential streaming completions (a ~128-token prompt, --output-tokens
out) over its OpenAI door and prints each one's time to first token. For the warm requests it prints how the tokens
arrived too: tokens per SSE event and the gaps between events (vLLM bench's ITL), against the time per token (TPOT);
a stream that delivers as fast as it generates sends one token an event. Before the first timed request the client
runs one request against a server of its own (--cold-client leaves it out), so the first figure is the server's.

    python -m benchmarks.gpu.first_request [--requests 8] [--output-tokens 16] -- --device cuda --model DIR \
        --load-format dummy --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from benchmarks.processes import free_port


@dataclass
class Stream:
    ttft_ms: float
    events: list[tuple[float, int]]  # (arrival, tokens in it), the first one's included

    @property
    def gaps_ms(self) -> list[float]:
        return [1e3 * (b[0] - a[0]) for a, b in zip(self.events, self.events[1:])]

    @property
    def tpot_ms(self) -> float:
        tokens = sum(n for _, n in self.events)
        return 1e3 * (self.events[-1][0] - self.events[0][0]) / max(tokens - 1, 1)


def stream(url: str, prompt: str, output_tokens: int) -> Stream:
    body = json.dumps({"prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True, "logprobs": 1}).encode()  # logprobs: a token each, text or not
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    events = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            choices = json.loads(line[6:])["choices"] if line.startswith(b"data: {") else []
            if choices and choices[0].get("logprobs"):
                events.append((time.perf_counter(), len(choices[0]["logprobs"]["tokens"])))
    if not events:
        raise RuntimeError("the stream ended without a token")
    return Stream(1e3 * (events[0][0] - start), events)


def warm_client() -> float:
    """Run this process's urllib through a whole request against a server of its own (a thread, loopback), so the
    first timed request measures the server's first request, not the client's: Python 3.12's urllib builds its
    default opener, with an SSL context and the system's CA certificates, at its first urlopen (about 20 ms on the
    GPU machine). The milliseconds it took."""
    import http.server
    import threading

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    start = time.perf_counter()
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{server.server_address[1]}/v1/completions", b"{}",
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            for _ in response:
                pass
    finally:
        server.shutdown()
        server.server_close()
    return 1e3 * (time.perf_counter() - start)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--cold-client", action="store_true",
                        help="time the first request with the client's own first-use costs in it")
    parser.add_argument("up_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    http = free_port()
    started = time.monotonic()
    up = subprocess.Popen([sys.executable, "-u", "-m", "services", "up", "--router-port", "0", "--http-port", str(http),
                           *[a for a in args.up_args if a != "--"]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    try:
        for line in up.stdout:
            if "TensorStore)" in line or "failed" in line or "Error" in line or " router" in line[:12]:
                print(line.rstrip(), flush=True)
            if "A process that dies" in line:
                break
        print(f"up to SERVING: {time.monotonic() - started:.1f} s", flush=True)
        url = f"http://127.0.0.1:{http}"
        if not args.cold_client:
            print(f"client warmed against a server of its own first: {warm_client():.1f} ms", flush=True)
        words = " ".join(f"word{i}" for i in range(100))
        streams = [stream(url, f"{i}: {words}", args.output_tokens) for i in range(args.requests)]
        times = [s.ttft_ms for s in streams]
        print("TTFT ms, in order:", " ".join(f"{t:.1f}" for t in times))
        warm = sorted(times[2:])[len(times[2:]) // 2]
        print(f"first {times[0]:.1f} ms, warm median {warm:.1f} ms: {times[0] / warm:.2f}x")
        later = streams[2:]
        gaps = [g for s in later for g in s.gaps_ms]
        sizes = [n for s in later for _, n in s.events]
        if gaps:
            print(f"warm streams: {sum(sizes) / len(sizes):.2f} tokens an event (most {max(sizes)}); event gap mean "
                  f"{sum(gaps) / len(gaps):.2f} ms, p99 {percentile(gaps, 0.99):.2f} ms; TPOT mean "
                  f"{sum(s.tpot_ms for s in later) / len(later):.2f} ms")
    finally:
        up.send_signal(2)
        up.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())

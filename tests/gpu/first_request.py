"""TTFT of the first requests a fresh `disagg up` serves against later ones: starts `up` with the arguments given,
reports each worker's ready line, then sends sequential streaming completions (a ~128-token prompt, 16 tokens out)
over its OpenAI door and prints each one's time to first token.

    python -m tests.gpu.first_request [--requests 8] -- --device cuda --model DIR --load-format dummy --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request

from tests.integration.processes import free_port


def ttft_ms(url: str, prompt: str) -> float:
    body = json.dumps({"prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True,
                       "ignore_eos": True, "logprobs": 1}).encode()  # logprobs: a chunk a token, text or not
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            choices = json.loads(line[6:])["choices"] if line.startswith(b"data: {") else []
            if choices and (choices[0].get("text") or choices[0].get("logprobs")):
                first = time.perf_counter()
                for _ in response:  # the rest of the stream
                    pass
                return 1e3 * (first - start)
    raise RuntimeError("the stream ended without text")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("up_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    http = free_port()
    started = time.monotonic()
    up = subprocess.Popen([sys.executable, "-u", "-m", "services", "up", "--router-port", "0", "--http-port", str(http),
                           *[a for a in args.up_args if a != "--"]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    try:
        for line in up.stdout:
            if "TensorStore)" in line or "failed" in line or "Error" in line:
                print(line.rstrip(), flush=True)
            if "A process that dies" in line:
                break
        print(f"up to SERVING: {time.monotonic() - started:.1f} s", flush=True)
        url = f"http://127.0.0.1:{http}"
        words = " ".join(f"word{i}" for i in range(100))
        times = [ttft_ms(url, f"{i}: {words}") for i in range(args.requests)]
        print("TTFT ms, in order:", " ".join(f"{t:.1f}" for t in times))
        warm = sorted(times[2:])[len(times[2:]) // 2]
        print(f"first {times[0]:.1f} ms, warm median {warm:.1f} ms: {times[0] / warm:.2f}x")
    finally:
        up.send_signal(2)
        up.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())

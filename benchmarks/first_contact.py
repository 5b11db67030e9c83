"""What the first request after a start pays, against the requests after it (prefill → decode, real processes).

    python -m benchmarks.first_contact [--model DIR] [--requests 8] [--max-tokens 4] [--device cpu]

Starts a prefill worker, a decode worker and a router (the tiny random text model of the integration tests unless
--model), then sends requests one at a time and prints, per request, each token's arrival after the send and the
router's TTFT parts. The peer is the same stack's later requests: a first request slower than them by more than its
own compute is a first-contact cost (the decode worker once made its KV puller at the first pull, on its event loop:
the second token came 634-862 ms after the send, against 21 ms for the next requests, on 2 CPU cores; 33-55 ms
since).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402
from benchmarks.processes import start_services, stop_in_waves  # noqa: E402
from benchmarks.text_model import make_text_model  # noqa: E402


def _one(address: str, index: int, max_tokens: int) -> tuple[list[float], common_pb2.TtftBreakdown, str]:
    request = generation_pb2.GenerateRequest(
        prompt=f"The lighthouse keeper said {index}", sampling=common_pb2.SamplingParams(temperature=0,
                                                                                          max_tokens=max_tokens),
        stop=common_pb2.StopConditions(ignore_eos=True))
    arrivals, last = [], None
    start = time.perf_counter()
    with grpc.insecure_channel(address) as channel:
        for response in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60):
            arrivals.append((time.perf_counter() - start) * 1000)
            last = response
    usage = last.finished.usage
    backend = common_pb2.TransferBackend.Name(usage.kv_transfer_backend).removeprefix("TRANSFER_BACKEND_").lower()
    return arrivals, usage.ttft_breakdown, backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: the tests' tiny random text model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or str(make_text_model(Path(scratch) / "tiny-text"))
        flags = ("--model", model, "--device", args.device)
        env = {"OMP_NUM_THREADS": "1"}
        workers = start_services([("prefill", flags), ("decode", flags)], env=env)
        try:
            workers += start_services([("router", ("--model", model, "--prefill-workers", workers[0].address,
                                                   "--decode-workers", workers[1].address))], env=env)
            second_token_ms = []
            print("request  token arrivals after the send (ms)            KV handoff  first decode step  backend")
            for i in range(args.requests):
                arrivals, parts, backend = _one(workers[2].address, i, args.max_tokens)
                second_token_ms.append(arrivals[1] if len(arrivals) > 1 else float("nan"))
                print(f"{i:7d}  {' '.join(f'{a:6.1f}' for a in arrivals):44s}  {parts.kv_handoff_ms:8.1f}  "
                      f"{parts.first_decode_step_ms:17.1f}  {backend}")
            later = statistics.median(second_token_ms[1:]) if len(second_token_ms) > 1 else float("nan")
            print(f"second token: first request {second_token_ms[0]:.1f} ms, later requests' median {later:.1f} ms "
                  f"({second_token_ms[0] / later:.1f}x)")
        finally:
            stop_in_waves(workers)


if __name__ == "__main__":
    main()

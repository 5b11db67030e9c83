"""KV pull bandwidth: TensorStore.Pull of a prefilled session vs a plain loopback TCP copy of the same bytes.

    python benchmarks/kv_pull_bandwidth.py [--model default] [--tokens 512 2048] [--repeats 5]

Starts a real prefill worker, prefills one random prompt per size, pulls its session
`--repeats` times over gRPC (export on the engine thread, chunking, protobuf, reassembly and
header checks included) and copies the same number of bytes over a loopback socket in this
run, and pulls it through the same-host `shm` fast path. Prints the median MB/s of each.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.kv import host  # noqa: E402
from common.kv.store import pull_kv  # noqa: E402
from common.kv.wire import ChannelCache, release_session  # noqa: E402
from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402
from benchmarks.processes import start_service  # noqa: E402

MB = 1e6


def prefill_session(address: str, num_tokens: int, seed: int) -> common_pb2.KvSessionRef:
    """A pinned session for a random prompt (retrying in the rare case the first token is EOS)."""
    import random

    rng = random.Random(seed)
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.PrefillerStub(channel)
        for _ in range(5):
            prompt = [rng.randrange(100, 10_000) for _ in range(num_tokens)]
            response = stub.Prefill(worker_pb2.PrefillRequest(
                token_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0, max_tokens=2)), timeout=600)
            if response.HasField("session"):
                return response.session
    raise RuntimeError("no session after 5 prompts")


async def timed_pulls(ref: common_pb2.KvSessionRef, repeats: int) -> tuple[int, list[float], list[float]]:
    """Times of pulls over the gRPC stream and through the same-host shm fast path (common.kv.transports.shm)."""
    over_grpc = common_pb2.KvSessionRef()
    over_grpc.CopyFrom(ref)
    del over_grpc.attributes[host.HOST_ID_ATTRIBUTE]  # an importer on another host sees no shared host
    channels = ChannelCache()
    try:
        channel = channels.get(ref.endpoint)
        await pull_kv(channel, over_grpc)  # warm-up: connection, allocator
        times = {"grpc": [], "shm": []}
        size = 0
        for _ in range(repeats):
            for target in (over_grpc, ref):
                start = time.perf_counter()
                pulled = await pull_kv(channel, target)
                times[pulled.transport].append(time.perf_counter() - start)
                size = pulled.num_bytes
        await release_session(channel, ref.session_id)
        return size, times["grpc"], times["shm"]
    finally:
        await channels.close()


def tcp_copies(num_bytes: int, repeats: int) -> list[float]:
    """Send `num_bytes` over one loopback connection per copy; time from request to the last byte."""
    payload = os.urandom(num_bytes)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while conn.recv(1):
                conn.sendall(payload)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    buffer, times = bytearray(num_bytes), []
    with socket.create_connection(listener.getsockname()) as client, memoryview(buffer) as view:
        for i in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            client.sendall(b"x")
            received = 0
            while received < num_bytes:
                received += client.recv_into(view[received:])
            if i:
                times.append(time.perf_counter() - start)
    server.join(timeout=5)
    listener.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    blocks = max(args.tokens) // 16 + 64
    prefill = start_service("prefill", "--model", args.model, "--dtype", args.dtype, "--num-kv-blocks", str(blocks))
    try:
        print(f"prefill worker {prefill.address}, model {args.model}, dtype {args.dtype}, "
              f"{args.repeats} pulls per size, {os.cpu_count()} CPUs")
        print(f"{'tokens':>7} {'KV MB':>8} {'gRPC MB/s':>10} {'TCP MB/s':>10} {'gRPC/TCP':>9} {'pull ms':>8} "
              f"{'shm MB/s':>9} {'shm ms':>7}")
        for num_tokens in args.tokens:
            ref = prefill_session(prefill.address, num_tokens, seed=num_tokens)
            size, pulls, shm_pulls = asyncio.run(timed_pulls(ref, args.repeats))
            copies = tcp_copies(size, args.repeats)
            grpc_rate, tcp_rate = size / statistics.median(pulls) / MB, size / statistics.median(copies) / MB
            print(f"{num_tokens:>7} {size / MB:>8.1f} {grpc_rate:>10.0f} {tcp_rate:>10.0f} {grpc_rate / tcp_rate:>9.2f} "
                  f"{statistics.median(pulls) * 1000:>8.1f} {size / statistics.median(shm_pulls) / MB:>9.0f} "
                  f"{statistics.median(shm_pulls) * 1000:>7.1f}")
    finally:
        code = prefill.stop()
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

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
from typing import Callable, NamedTuple

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.kv import host  # noqa: E402
from common.kv.store import pull_kv  # noqa: E402
from common.kv.transports.nixl import NixlTransport  # noqa: E402
from common.kv.wire import ChannelCache, release_session  # noqa: E402
from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402
from benchmarks.processes import start_service  # noqa: E402

MB = 1e6
# Untimed pulls through each transport first, each checked against the first gRPC pull: a fresh importer's first
# gRPC pulls of a large session ran at a quarter to a half of its later speed (its allocator and its connection's
# buffers still growing), levelling off by the sixth; a serving worker pulls many sessions.
WARM_UP_PULLS = 6


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


class Timed(NamedTuple):
    """Seconds of each timed operation, and the CPU seconds `cpu` counted meanwhile (empty without a clock)."""

    seconds: list[float]
    cpu_seconds: list[float]


async def timed_pulls(ref: common_pb2.KvSessionRef, repeats: int, transports: tuple[str, ...] = ("grpc", "shm"),
                      cpu: Callable[[], float] | None = None) -> tuple[int, dict[str, Timed]]:
    """Times of pulls of `ref` for each of `transports`, interleaved: "grpc" over the gRPC stream (the ref as an
    importer on another host sees it, no shared host), "shm" through the same-host fast path
    (common.kv.transports.shm), "nixl" the NIXL transport's one-sided read into host memory (the read alone: its
    Release would end the session). WARM_UP_PULLS untimed ones through each first check that all moved the same
    bytes. `cpu`: a clock of CPU seconds (e.g. both ends' processes) read around each pull. The session is released
    at the end."""
    over_grpc = common_pb2.KvSessionRef()
    over_grpc.CopyFrom(ref)
    over_grpc.attributes.pop(host.HOST_ID_ATTRIBUTE, None)
    channels = ChannelCache()
    nixl = NixlTransport() if "nixl" in transports else None
    try:
        channel = channels.get(ref.endpoint)

        async def pull(transport: str) -> tuple[str, torch.Tensor]:
            if transport == "nixl":
                return transport, await nixl.read(torch.device("cpu"), channel, over_grpc)
            pulled = await pull_kv(channel, over_grpc if transport == "grpc" else ref)
            return pulled.transport, pulled.export.blocks

        reference = (await pull("grpc"))[1]
        for _ in range(WARM_UP_PULLS):
            for transport in transports:
                name, blocks = await pull(transport)
                if not torch.equal(blocks.view(torch.uint8), reference.view(torch.uint8)):
                    raise AssertionError(f"a {name} pull of session {ref.session_id} differs from its gRPC pull")
        times = {transport: Timed([], []) for transport in transports}
        for _ in range(repeats):
            for transport in transports:
                before, start = cpu() if cpu else 0.0, time.perf_counter()
                name, _ = await pull(transport)
                times[name].seconds.append(time.perf_counter() - start)
                if cpu:
                    times[name].cpu_seconds.append(cpu() - before)
        await release_session(channel, ref.session_id)
        return reference.numel() * reference.element_size(), times
    finally:
        if nixl is not None:
            nixl.close()
        await channels.close()


def serve_copies(listener: socket.socket) -> None:
    """One connection of `listener`: each 8-byte size it is sent is answered with that many bytes."""
    conn, _ = listener.accept()
    with conn:
        payload = b""
        while asked := conn.recv(8):
            size = int.from_bytes(asked, "big")
            if len(payload) != size:
                payload = os.urandom(size)
            conn.sendall(payload)


def timed_copies(address: tuple[str, int], num_bytes: int, repeats: int,
                 cpu: Callable[[], float] | None = None) -> Timed:
    """Times of `repeats` copies of `num_bytes` from serve_copies at `address` over one connection (after one
    warm-up), each from the request to its last byte; `cpu` as in timed_pulls."""
    buffer, timed = bytearray(num_bytes), Timed([], [])
    with socket.create_connection(address, timeout=30) as client, memoryview(buffer) as view:
        for i in range(repeats + 1):
            before, start = cpu() if cpu and i else 0.0, time.perf_counter()
            client.sendall(num_bytes.to_bytes(8, "big"))
            received = 0
            while received < num_bytes:
                received += client.recv_into(view[received:])
            if i:
                timed.seconds.append(time.perf_counter() - start)
                if cpu:
                    timed.cpu_seconds.append(cpu() - before)
    return timed


def tcp_copies(num_bytes: int, repeats: int) -> list[float]:
    """timed_copies over a loopback connection in this process."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = threading.Thread(target=serve_copies, args=(listener,), daemon=True)
        server.start()
        times = timed_copies(listener.getsockname(), num_bytes, repeats).seconds
        server.join(timeout=5)
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
            size, times = asyncio.run(timed_pulls(ref, args.repeats))
            pulls, shm_pulls = times["grpc"].seconds, times["shm"].seconds
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

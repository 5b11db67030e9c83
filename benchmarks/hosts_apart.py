"""KV pull bandwidth between hosts apart (benchmarks.netns namespaces) next to a raw TCP stream between the same two.

    python -m benchmarks.hosts_apart [--model default] [--tokens 2048] [--repeats 5] [--rate 2gbit]

A prefill worker (--kv-transports grpc,nixl) in one namespace prefills a prompt (kv_pull_bandwidth.prefill_session);
a process in the other pulls its session `--repeats` times over TensorStore.Pull and through NIXL's one-sided read
(UCX over TCP alone, UCX_TLS=tcp, as between hosts without RDMA; left out, with NIXL's reason, where NIXL cannot
run), interleaved, and receives the same number of bytes from a plain socket sender in the prefill's namespace.
`--rate` shapes the prefill host's veth with tc tbf, so the link, not the CPU, is the limit. Prints the median MB/s
of each, each pull's ratio to raw TCP, and the CPU time both ends spent per pull (the importer's process and the
prefill worker's; the receiver's and the sender's for raw TCP), which says what bounds a pull on an unshaped link.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from benchmarks.cpu_time import TICKS_PER_S, cpu_ticks
from benchmarks.kv_pull_bandwidth import MB, prefill_session, serve_copies, timed_copies, timed_pulls
from benchmarks.netns import hosts_apart
from common.kv.transports.nixl import nixl_unavailable_reason
from common.pb.disagg.v1 import common_pb2

TCP_PORT = 5601
UCX_OVER_TCP = {"UCX_TLS": "tcp"}  # else UCX reaches a peer on this kernel through shared memory, off the link


def _send_tcp(address: str) -> None:
    with socket.create_server((address, TCP_PORT)) as listener:
        serve_copies(listener)


def _importer(args) -> int:
    ref = common_pb2.KvSessionRef.FromString(base64.b64decode(args.pull))

    def both_ends(peer: int):  # CPU seconds of this process and of the peer process serving it
        return lambda: time.process_time() + cpu_ticks(peer) / TICKS_PER_S

    size, pulls = asyncio.run(timed_pulls(ref, args.repeats, tuple(args.transports.split(",")),
                                          both_ends(args.exporter_pid)))
    copies = timed_copies((args.tcp_from, TCP_PORT), size, args.repeats, both_ends(args.sender_pid))
    print(json.dumps({"bytes": size, "pulls": {name: timed._asdict() for name, timed in pulls.items()},
                      "tcp": copies._asdict()}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rate", help="tc tbf rate on the prefill host's link, e.g. 2gbit")
    parser.add_argument("--pull", help=argparse.SUPPRESS)  # the importer's side, run in the other namespace
    parser.add_argument("--tcp-from", help=argparse.SUPPRESS)
    parser.add_argument("--send-tcp", help=argparse.SUPPRESS)
    parser.add_argument("--transports", help=argparse.SUPPRESS)
    parser.add_argument("--exporter-pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sender-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.send_tcp:
        _send_tcp(args.send_tcp)
        return 0
    if args.pull:
        return _importer(args)
    nixl_reason = nixl_unavailable_reason()
    transports = ("grpc",) if nixl_reason else ("grpc", "nixl")
    with hosts_apart(2) as net:
        near, far = net.hosts
        if args.rate:
            near.shape(args.rate)
        prefill = near.spawn("prefill", "--model", args.model, "--dtype", args.dtype, "--kv-transports",
                             ",".join(transports), "--num-kv-blocks", str(args.tokens // 16 + 64), env=UCX_OVER_TCP)
        sender = near.popen(sys.executable, "-m", "benchmarks.hosts_apart", "--send-tcp", near.address)
        try:
            prefill.wait_ready()
            ref = prefill_session(prefill.address, args.tokens, seed=args.tokens)
            result = subprocess.run(far.command(
                sys.executable, "-m", "benchmarks.hosts_apart", "--pull",
                base64.b64encode(ref.SerializeToString()).decode(), "--tcp-from", near.address,
                "--repeats", str(args.repeats), "--transports", ",".join(transports),
                "--exporter-pid", str(prefill.popen.pid), "--sender-pid", str(sender.pid)),
                capture_output=True, text=True, timeout=600, env={**os.environ, **UCX_OVER_TCP})
            if result.returncode:
                raise RuntimeError(result.stderr)
            figures = json.loads(result.stdout.strip().splitlines()[-1])
        finally:
            sender.kill()
            sender.wait()
            prefill.stop()
    size = figures["bytes"]

    def rate_and_cpu(timed: dict) -> tuple[float, float]:
        return size / statistics.median(timed["seconds"]) / MB, statistics.mean(timed["cpu_seconds"]) * 1000

    tcp_rate, tcp_cpu = rate_and_cpu(figures["tcp"])
    print(f"model {args.model}, {args.tokens} tokens, {size / MB:.1f} MB of KV, link {args.rate or 'unshaped'}, "
          f"{args.repeats} repeats, {os.cpu_count()} CPUs" + (f"; NIXL left out: {nixl_reason}" if nixl_reason else ""))
    print(f"{'':>7} {'MB/s':>6} {'/raw TCP':>9} {'CPU ms':>7}")
    for name in transports:
        rate, cpu = rate_and_cpu(figures["pulls"][name])
        print(f"{name:>7} {rate:>6.0f} {rate / tcp_rate:>9.2f} {cpu:>7.0f}")
    print(f"{'raw TCP':>7} {tcp_rate:>6.0f} {1:>9.2f} {tcp_cpu:>7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

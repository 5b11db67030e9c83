"""KV pull bandwidth between hosts apart (benchmarks.netns namespaces) next to a raw TCP stream between the same two.

    python -m benchmarks.hosts_apart [--model default] [--tokens 2048] [--repeats 5] [--rate 2gbit]

A prefill worker (--kv-transports grpc,nixl) in one namespace prefills a prompt (kv_pull_bandwidth.prefill_session);
a process in the other pulls its session `--repeats` times over TensorStore.Pull and through NIXL's one-sided read
(UCX over TCP alone, UCX_TLS=tcp, as between hosts without RDMA; left out, with NIXL's reason, where NIXL cannot
run), interleaved, and receives the same number of bytes from a plain socket sender in the prefill's namespace.
`--rate` shapes the prefill host's veth with tc tbf, so the link, not the CPU, is the limit. Prints the median MB/s
of each and each pull's ratio to raw TCP.
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
    size, pulls = asyncio.run(timed_pulls(ref, args.repeats, transports=tuple(args.transports.split(","))))
    copies = timed_copies((args.tcp_from, TCP_PORT), size, args.repeats)
    print(json.dumps({"bytes": size, "pull_s": pulls, "tcp_s": copies}))
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
                "--repeats", str(args.repeats), "--transports", ",".join(transports)),
                capture_output=True, text=True, timeout=600, env={**os.environ, **UCX_OVER_TCP})
            if result.returncode:
                raise RuntimeError(result.stderr)
            figures = json.loads(result.stdout.strip().splitlines()[-1])
        finally:
            sender.kill()
            sender.wait()
            prefill.stop()
    size = figures["bytes"]
    tcp_rate = size / statistics.median(figures["tcp_s"]) / MB
    print(f"model {args.model}, {args.tokens} tokens, {size / MB:.1f} MB of KV, link {args.rate or 'unshaped'}, "
          f"{args.repeats} repeats, {os.cpu_count()} CPUs" + (f"; NIXL left out: {nixl_reason}" if nixl_reason else ""))
    print(f"{'pull':>6} {'MB/s':>6} {'raw TCP MB/s':>13} {'pull/TCP':>9}")
    for name in transports:
        rate = size / statistics.median(figures["pull_s"][name]) / MB
        print(f"{name:>6} {rate:>6.0f} {tcp_rate:>13.0f} {rate / tcp_rate:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

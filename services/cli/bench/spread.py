"""`disagg bench --clients N`: one workload's arrivals sent by N client processes, so the client is not the limit.

One Python client times every token on one event loop, about 100 µs a token, so near 10 000 tokens/s it becomes the
slowest part of the measurement. Each process sends the requests i with i mod N == k at the same offsets from a common
start as one client would (the same Poisson schedule), times them with the system-wide monotonic clock, and hands its
records back; the summary is over all of them. --max-concurrency is split over the processes."""
from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import queue
import time

from common import tls
from services.cli.bench.clients import SendOptions, make_client
from services.cli.bench.runner import Sent, send_scheduled
from services.cli.bench.workload import BenchRequest, arrival_offsets

_START_MARGIN_S = 0.2  # after every process is ready: the first arrival's offset from "now"


@dataclasses.dataclass(frozen=True)
class ClientSpec:
    """What a client process needs to make its client (clients.make_client) as the parent would."""

    api: str
    router: str
    http: str
    max_concurrency: int | None
    api_key: str | None
    tls: tls.TlsConfig


def run_spread(spec: ClientSpec, requests: list[BenchRequest], rate: float, seed: int, options: SendOptions,
               clients: int) -> Sent:
    """Every request through `clients` processes (see the module doc): the records in request order, the wall time
    from the first send to the last end, and each process's loop busy share."""
    offsets = arrival_offsets(len(requests), rate, seed)
    context = multiprocessing.get_context("spawn")  # never fork a process whose gRPC is running
    ready = context.Barrier(clients + 1)
    results = context.Queue()
    spec = dataclasses.replace(spec, max_concurrency=-(-spec.max_concurrency // clients) if spec.max_concurrency
                               else None)
    processes = [context.Process(target=_client_main, daemon=True, args=(
        spec, requests[k::clients], offsets[k::clients], options, ready, results)) for k in range(clients)]
    for process in processes:
        process.start()
    try:
        ready.wait(timeout=120)  # every client has its channel
        shares = _collect(results, processes)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    records = sorted((record for share in shares for record in share.records), key=lambda r: r.index)
    sent = [r for r in records if r.start]
    duration = max(r.end for r in sent) - min(r.start for r in sent) if sent else 0.0
    return Sent(records, duration, [busy for share in shares for busy in share.loop_busy])


def _collect(results, processes: list) -> list[Sent]:
    """Every process's share; a process that died without handing it back is an error, not a wait."""
    shares: list[Sent] = []
    while len(shares) < len(processes):
        try:
            shares.append(results.get(timeout=1))
        except queue.Empty:
            dead = [p for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a bench client process ended with code {dead[0].exitcode}") from None
    return shares


def _client_main(spec: ClientSpec, requests: list[BenchRequest], offsets: list[float], options: SendOptions,
                 ready, results) -> None:
    tls.configure(spec.tls)
    results.put(asyncio.run(_send_share(spec, requests, offsets, options, ready)))


async def _send_share(spec: ClientSpec, requests: list[BenchRequest], offsets: list[float], options: SendOptions,
                      ready) -> Sent:
    client = make_client(spec.api, spec.router, spec.http, spec.max_concurrency, api_key=spec.api_key)
    try:
        await asyncio.to_thread(ready.wait, 120)
        start = time.perf_counter() + _START_MARGIN_S  # CLOCK_MONOTONIC: the same in every process
        return await send_scheduled(client, requests, offsets, spec.max_concurrency, options, start)
    finally:
        await client.close()

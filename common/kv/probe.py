"""The transport self-check: the first time a decode worker meets an exporter, it pulls a few blocks through every
transport the exporter offers and this worker can use, logs the GB/s of each, and reports them
(`disagg_kv_probe_gbps{peer,backend}`, the label naming the transport). A transport that fails here is marked broken for
that peer at once, with a WARNING that gives the reason and names the transport pulls fall back to, and counted in
`disagg_kv_pull_fallbacks_total{backend}`: nobody runs on a slow path without a line saying so. A transport whose first
use starts what then keeps running (`nixl`: its agents and the exporter's progress thread) is tried only when no better
transport worked: where pulls will not use it, it never starts.

A probe reads no session: one-sided transports read the first blocks of the exporter's cache into scratch
memory; two-sided ones pull the handle PROBE_HANDLE, which the exporter answers with blocks of zeros
(common.kv.paths.DataPlane.export) without touching its engine. Nothing is held, so nothing is released.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

import grpc
from opentelemetry import context as otel_context

from common.kv.errors import TransportUnavailable
from common.kv.fence import EPOCH_ATTRIBUTE
from common.kv.transport import Importer, KvTransport
from common.pb.disagg.v1 import common_pb2
from common.telemetry import tracing

log = logging.getLogger(__name__)
PROBE_HANDLE = "kv-transfer-probe"
PROBE_BLOCKS = 4


def probe_ref(ref: common_pb2.KvSessionRef, num_blocks: int = PROBE_BLOCKS) -> common_pb2.KvSessionRef:
    """A ref of the same exporter and layout naming the probe handle and blocks 0..num_blocks-1."""
    probe = common_pb2.KvSessionRef()
    probe.CopyFrom(ref)
    probe.session_id = PROBE_HANDLE
    probe.num_tokens = num_blocks * ref.block_size
    del probe.block_ids[:]
    probe.block_ids.extend(range(num_blocks))
    probe.attributes.pop(EPOCH_ATTRIBUTE, None)
    return probe


class Negotiator(Importer, Protocol):
    """The importer whose transports the self-check tries (common.kv.pull.KvPuller)."""

    transports: dict[str, KvTransport]

    def candidates(self, ref: common_pb2.KvSessionRef) -> list[str]:
        """The transports to try for this ref, best first."""

    def fall_back(self, endpoint: str, name: str, reason: str) -> None:
        """Mark a transport broken for that exporter, saying why."""

    async def usable(self, name: str) -> bool:
        """Whether the transport can run in this process (some are checked only when first needed)."""


class SelfCheck:
    """Probes each exporter endpoint once, in the background of the first pull from it."""

    def __init__(self, puller: Negotiator, on_result: Callable[[str, str, float], None] | None = None):
        self.puller = puller
        self.on_result = on_result  # (peer, transport, GB/s; 0 when it failed)
        self.results: dict[str, dict[str, float]] = {}  # peer → transport → GB/s
        self._tasks: dict[str, asyncio.Task] = {}

    def start(self, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef) -> None:
        if ref.endpoint not in self._tasks:
            self._tasks[ref.endpoint] = asyncio.ensure_future(self.run(channel, ref))

    async def wait(self, endpoint: str) -> dict[str, float]:
        await self._tasks[endpoint]
        return self.results[endpoint]

    async def run(self, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef) -> None:
        # A trace of its own: the request whose pull met the peer first is not where the probes belong.
        with tracing.tracer().start_as_current_span("kv_self_check", context=otel_context.Context(),
                                                    attributes={"disagg.exporter": ref.endpoint}):
            await self._probe_all(channel, ref)

    async def _probe_all(self, channel: grpc.aio.Channel, ref: common_pb2.KvSessionRef) -> None:
        probe, results, untried = probe_ref(ref), {}, []
        for transport in self.puller.candidates(ref):
            candidate = self.puller.transports.get(transport)
            if candidate is None:  # found unusable here since the list was made
                continue
            if candidate.starts_on_first_use and any(results.values()):
                untried.append(transport)  # a better transport works: pulls will not start this one
                continue
            if not await self.puller.usable(transport):
                continue
            try:
                results[transport] = await self._gbps(channel, probe, transport)
            except (TransportUnavailable, grpc.aio.AioRpcError, OSError, RuntimeError) as exc:
                results[transport] = 0.0
                reason = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                self.puller.fall_back(ref.endpoint, transport, f"the self-check pull failed: {reason}")
        self.results[ref.endpoint] = results
        log.info("KV transfer self-check with %s (%d blocks): %s%s", ref.endpoint, PROBE_BLOCKS,
                 ", ".join(f"{b} {gbps:.2f} GB/s" if gbps else f"{b} failed" for b, gbps in results.items()),
                 f"; not tried (a better transport works): {', '.join(untried)}" if untried else "")
        working = [b for b, gbps in results.items() if gbps]
        if working and working[0] != next(iter(results)):
            log.warning("KV pulls from %s fall back to %s (%.2f GB/s in the self-check): %s failed there",
                        ref.endpoint, working[0], results[working[0]], ", ".join(b for b in results if not results[b]))
        for transport, gbps in results.items():
            if self.on_result is not None:
                self.on_result(ref.endpoint, transport, gbps)

    async def _gbps(self, channel: grpc.aio.Channel, probe: common_pb2.KvSessionRef, name: str) -> float:
        start = time.perf_counter()
        num_bytes = await self.puller.transports[name].probe(self.puller, channel, probe)
        return num_bytes / max(time.perf_counter() - start, 1e-9) / 1e9

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

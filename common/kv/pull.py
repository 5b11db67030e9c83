"""The importer's side of the KV data plane: negotiate a transport per session, pull, release.

For each KvSessionRef the puller tries the exporter's offered transports (best first, common.kv.transport) that
this worker accepts, can run here, and that apply to the ref; `grpc` always works and comes last. A transport that
cannot serve a peer (TransportUnavailable: no shared GPU, another container, NIXL missing) is logged once per peer
with the reason, counted, skipped for that peer for a while, and the next one is tried; the session is still
pinned then, so nothing is lost. Each transport pulls the session and releases it through the importer's Releases
(common.kv.wire), which send every Release it owes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import torch

from common.kv import transport
from common.kv.blocks import KvBlocks
from common.kv.errors import TransportUnavailable
from common.kv.offer import offered
from common.kv.probe import SelfCheck
from common.kv.wire import ChannelCache, PulledKv, Releases
from common.pb.disagg.v1 import common_pb2

log = logging.getLogger(__name__)
RETRY_BROKEN_AFTER_S = 60.0  # a transport that failed for a peer is tried again after this


class KvPuller:
    def __init__(self, channels: ChannelCache, device: torch.device, accepted: tuple[str, ...] | None = None,
                 on_fallback: Callable[[str, str], None] | None = None, blocks: KvBlocks | None = None,
                 on_probe: Callable[[str, str, float], None] | None = None, self_check: bool = True,
                 releases: Releases | None = None):
        self.channels = channels
        self.device = device
        self.blocks = blocks  # the engine's cache and pool: cuda_ipc copies straight into its blocks
        self.releases = releases or Releases(channels)  # the worker's (its KvPath's), where it has one
        self.self_check = SelfCheck(self, on_probe) if self_check else None
        # Transports checked when first about to be used: name → that check (None until it starts), one for every
        # pull and self-check that waits on it; dropped once answered.
        self._first_use_checks: dict[str, asyncio.Future[str | None] | None] = {}
        self.transports = self._usable(accepted or transport.names())
        self.on_fallback = on_fallback  # (transport, reason) → e.g. a metric
        self._broken: dict[tuple[str, str], float] = {}  # (endpoint, transport) → when it failed

    def _usable(self, accepted: tuple[str, ...]) -> dict[str, transport.KvTransport]:
        usable = {}
        for name in accepted:
            candidate = transport.create(name)
            if candidate.starts_on_first_use:
                # Its check alone is costly (NIXL's makes an agent: 0.5 s of a core), and most workers never use it.
                self._first_use_checks[name] = None
                usable[name] = candidate
                continue
            reason = candidate.unavailable_reason(self.device)
            if reason is None:
                usable[name] = candidate
            else:
                log.info("KV transport %s not used by this worker: %s", name, reason)
        usable.setdefault(transport.FALLBACK, transport.create(transport.FALLBACK))
        return usable

    async def usable(self, name: str) -> bool:
        """Whether the transport can run here, checked (off the event loop) the first time it is about to be used;
        one that cannot is dropped for good, saying why."""
        if name in self._first_use_checks:
            check = self._first_use_checks[name]
            if check is None:
                check = self._first_use_checks[name] = asyncio.ensure_future(
                    asyncio.to_thread(self.transports[name].unavailable_reason, self.device))
            reason = await asyncio.shield(check)
            self._first_use_checks.pop(name, None)  # answered: later pulls ask `transports` alone
            if reason is not None and self.transports.pop(name, None) is not None:
                log.info("KV transport %s not used by this worker: %s", name, reason)
        return name in self.transports

    def candidates(self, ref: common_pb2.KvSessionRef) -> list[str]:
        """The transports to try for this ref, in the exporter's order of preference; grpc last."""
        now = time.monotonic()
        out = []
        for name in offered(ref.attributes, ref.transfer_backend):
            if name not in self.transports or not self.transports[name].applies(ref):
                continue
            failed_at = self._broken.get((ref.endpoint, name))
            if failed_at is not None and now - failed_at < RETRY_BROKEN_AFTER_S:
                continue
            out.append(name)
        return [n for n in out if n != transport.FALLBACK] + [transport.FALLBACK]

    async def pull_and_release(self, ref: common_pb2.KvSessionRef, timeout_s: float | None = None) -> PulledKv:
        """The session's KV (on this worker's device); the ref was checked already (KvPath.check). The transport that
        pulls releases the session; a pull that ends before one has it is the caller's to release (DataPlane.import_kv
        runs this inside Releases.owing, which also covers making the puller). Raises grpc.aio.AioRpcError from the
        exporter, NotFound / Unavailable / LayoutMismatch."""
        channel = self.channels.get(ref.endpoint)
        if self.self_check is not None:
            self.self_check.start(channel, ref)  # once per exporter, in the background
        for name in self.candidates(ref):
            if not await self.usable(name):
                continue
            try:
                pulled = await self.transports[name].pull(self, channel, ref, timeout_s)
                return pulled._replace(transfer_backend=transport.number_of(name))
            except TransportUnavailable as exc:
                self.fall_back(ref.endpoint, name, str(exc))
        raise AssertionError("grpc is always a candidate and never unavailable")

    def fall_back(self, endpoint: str, name: str, reason: str) -> None:
        first = (endpoint, name) not in self._broken
        self._broken[(endpoint, name)] = time.monotonic()
        if first:
            log.warning("KV transport %s unavailable with %s: %s; falling back to the next transport",
                        name, endpoint, reason)
        if self.on_fallback is not None:
            self.on_fallback(name, reason)

    async def close(self) -> None:
        if self.self_check is not None:
            await self.self_check.close()
        await self.releases.close()
        for one in self.transports.values():
            one.close()

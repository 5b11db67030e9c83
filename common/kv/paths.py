"""The KV seam: a worker's KvPath, the only thing its services call to move KV, picked once per worker by what its
engine can do. An engine that moves KV itself (an OwnKvTransport) gets the EngineTransport it names, from the
registry (common.kv.transport); one that hosts KV sessions (a KvSessionHost) gets our data plane (DataPlane)."""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Sequence

import grpc

from common.engine.interface import Engine, KvImport, KvSessionHost, OwnKvTransport
from common.errors import FailedPrecondition, InvalidConfig, InvalidRequest, NotFound, Unavailable
from common.kv import gather, transport
from common.kv.chunks import tensor_to_bytes
from common.kv.errors import TransportUnavailable
from common.kv.layout import KvLayout
from common.kv.probe import PROBE_HANDLE
from common.kv.pull import KvPuller
from common.kv.session import KvSession
from common.kv.sharing import KvCacheExporter
from common.kv.wire import ChannelCache, PulledKv, Releases, kv_header, session_ref
from common.pb.disagg.v1 import common_pb2, worker_pb2
from common.telemetry.metrics import Metrics


class KvPath(ABC):
    """How one worker's sessions' KV moves, with two roles (as vLLM's KV connector has a scheduler and a worker side):
    - the exporter's (prefill): `ref` describes a pinned session for its importer; its TensorStore serves the
      session through `export` (Pull), `share` (OpenKvCache) and `release` (Release);
    - the importer's (decode): `check` a ref before taking it on, then `import_kv` its KV before a deadline (the
      session released whatever happens), or make from it the `engine_import` of an engine that fetches the KV
      itself; a session it owns but will not pull (refused, or fetched by its engine) it `give_back`s. Every Release
      it sends goes through its `releases`.
    Those of one worker share its engine, KV layout and channels to exporters."""

    moves: str  # how, in words, for a refusal that names both sides

    def __init__(self, engine: Engine | None, engine_name: str, layout: KvLayout | None = None) -> None:
        self.engine = engine
        self.engine_name = engine_name  # the worker's --engine
        self.layout = layout  # its engine's (what refs it exports describe)
        self.channels = ChannelCache()  # to exporters' TensorStores
        self.releases = Releases(self.channels)

    @abstractmethod
    def carries(self, transfer_backend: int) -> bool:
        """Whether the KV of a ref naming this TransferBackend moves this way."""

    @abstractmethod
    def transfer_backends(self) -> list[int]:
        """What this worker offers (prefill) or accepts (decode), best first (Worker/GetInfo)."""

    # --- the exporter's role ---

    async def ref(self, session: KvSession, endpoint: str) -> common_pb2.KvSessionRef:
        """A pinned session's handoff metadata, served by the TensorStore at `endpoint`."""
        transfer_backend, attributes = await self.ref_fields(session.session_id)
        return session_ref(self.layout, session, endpoint, transfer_backend, attributes)

    @abstractmethod
    async def ref_fields(self, session_id: str) -> tuple[int, dict[str, str]]:
        """A pinned session's KvSessionRef.transfer_backend and attributes."""

    @abstractmethod
    async def export(self, handle: str, block_ids: Sequence[int]) -> tuple[worker_pb2.TensorHeader, memoryview]:
        """TensorStore.Pull: a session's blocks (or `block_ids`, some of them) as a header and raw bytes; NotFound /
        TransportUnavailable saying why not."""

    @abstractmethod
    def share(self, name: str) -> worker_pb2.KvCacheShare:
        """TensorStore.OpenKvCache's answer for transport `name`; TransportUnavailable with the reason."""

    async def release(self, handle: str) -> bool:
        """TensorStore.Release: free a session's blocks; False when it was unknown, expired or released already."""
        return await self.engine.release_session(handle)

    async def missing_reason(self, handle: str) -> str:
        """Why a session is not held (unknown, expired, released), in words."""
        try:
            await self.engine.session(handle)
        except NotFound as exc:  # SessionExpired too
            return str(exc)
        return ""

    # --- the importer's role ---

    def check(self, ref: common_pb2.KvSessionRef) -> None:
        """FailedPrecondition naming both sides when the ref's KV moves another way (a trtllm prefill's ref at a torch
        decode worker, or the reverse); InvalidRequest when this way cannot use the ref."""
        if not self.carries(ref.transfer_backend):
            number = ref.transfer_backend
            name = common_pb2.TransferBackend.Name(number) if number in common_pb2.TransferBackend.values() \
                else str(number)
            raise FailedPrecondition(
                f"KV session {ref.session_id} was exported with transfer_backend {name}, to be moved "
                f"{transport.moves_of(number)}, but this decode worker runs --engine {self.engine_name}, which "
                f"imports KV only {self.moves}; run prefill and decode workers with the same --engine")
        self.check_ref(ref)

    @abstractmethod
    def check_ref(self, ref: common_pb2.KvSessionRef) -> None:
        """InvalidRequest for a ref of this way that it cannot use."""

    def engine_import(self, ref: common_pb2.KvSessionRef) -> KvImport | None:
        """The engine's kv_import made from the ref alone, its engine then fetching the KV itself (the session is
        given back once the engine has answered); None: the KV is pulled (import_kv)."""
        return None

    @abstractmethod
    async def import_kv(self, ref: common_pb2.KvSessionRef, timeout_s: float | None) -> PulledKv:
        """A checked ref's KV on this worker (in a tensor, or already in its engine's blocks), pulled within
        `timeout_s`, the session released whatever happened. NotFound (expired, released, stale) / Unavailable
        (the exporter or the pull failed) / InvalidRequest (a broken stream) / LayoutMismatch."""

    def give_back(self, ref: common_pb2.KvSessionRef) -> asyncio.Task:
        """Release a session this worker owns but will not pull, at its exporter, without waiting for the answer."""
        return self.releases.later(ref)

    async def close(self) -> None:
        """Frees what the worker's side holds (shares, agents), once the Releases on their way are answered."""
        await self.releases.close()
        await self.channels.close()


class DataPlane(KvPath):
    """Our KV data plane: a KvSessionHost's pinned blocks served by TensorStore over the transports negotiated per
    session (the exporter's KvCacheExporter; the importer's KvPuller, made in the background once the path opens)."""

    moves = transport.DATA_PLANE_MOVES

    def __init__(self, engine_name: str, accepted: tuple[str, ...], exporter: KvCacheExporter | None = None, *,
                 engine: Engine | None = None, layout: KvLayout | None = None, metrics: Metrics | None = None):
        super().__init__(engine, engine_name, layout)
        self.accepted = accepted  # --kv-transports
        self.exporter = exporter  # a prefill worker's: its cache and shares
        self.metrics = metrics
        self._making_puller: asyncio.Future[KvPuller] | None = None

    def carries(self, transfer_backend: int) -> bool:
        return transport.driving_engine_transport(transfer_backend) is None

    def transfer_backends(self) -> list[int]:
        names = self.exporter.offered if self.exporter is not None else self.accepted
        return [transport.number_of(name) for name in names]

    async def ref_fields(self, session_id: str) -> tuple[int, dict[str, str]]:
        exporter = self._exporter(session_id)  # its attributes, without a trip to the engine's thread
        return exporter.best_transport, exporter.attributes()

    async def export(self, handle: str, block_ids: Sequence[int]) -> tuple[worker_pb2.TensorHeader, memoryview]:
        """Pulled sessions are only leased by the engine (their blocks stay pinned through a release or the TTL until
        the lease ends); the gather runs on a side stream into pinned host memory, off the engine thread, which
        keeps stepping other requests meanwhile."""
        exporter = self._exporter(handle)
        if handle == PROBE_HANDLE:  # an importer's self-check: blocks of zeros, no session, no engine
            blocks = exporter.probe_blocks(self.layout)
            ids = list(range(blocks.shape[2]))
            return kv_header(self.layout, ids, blocks), tensor_to_bytes(await gather.gather_to_host(blocks, ids))
        lease = asyncio.ensure_future(self.engine.lease_session(handle, block_ids))
        try:
            ids = await asyncio.shield(lease)
            blocks = await gather.gather_to_host(exporter.kv_cache, ids)
        finally:  # a pull cancelled at any point, even before the engine answered the lease, ends it
            await asyncio.shield(asyncio.ensure_future(self._end_lease_once_taken(lease, handle)))
        return kv_header(self.layout, ids, blocks), tensor_to_bytes(blocks)

    async def _end_lease_once_taken(self, lease: asyncio.Future, handle: str) -> None:
        try:
            await lease
        except Exception:
            return  # no lease was taken (unknown or expired session, foreign block ids)
        await self.engine.end_lease(handle)

    def _exporter(self, handle: str) -> KvCacheExporter:
        if self.exporter is None:
            raise NotFound(f"this worker exports no KV sessions (no {handle})")
        return self.exporter

    def share(self, name: str) -> worker_pb2.KvCacheShare:
        if self.exporter is None:
            raise TransportUnavailable("this worker exports no KV cache")
        return self.exporter.share(name)

    def check_ref(self, ref: common_pb2.KvSessionRef) -> None:
        check_pullable(ref)

    async def import_kv(self, ref: common_pb2.KvSessionRef, timeout_s: float | None) -> PulledKv:
        try:
            async with self.releases.owing(ref):  # also while the puller is still being made
                return await (await self.puller()).pull_and_release(ref, timeout_s=timeout_s)
        except grpc.aio.AioRpcError as exc:
            what = f"KV session {ref.session_id} at {ref.endpoint}: {exc.code().name}: {exc.details()}"
            if exc.code() is grpc.StatusCode.NOT_FOUND:
                raise NotFound(what) from None
            raise Unavailable(f"could not pull {what}") from None

    def start_puller(self) -> None:
        """Start making the importer's negotiation (it needs the engine's KV device and blocks), off the event loop:
        it checks which transports can run here. Made at the first pull, on the loop, it held that handoff (0.5 s,
        when it also made a NIXL agent: KvPuller.usable now checks nixl at its first use) and every other stream."""
        if self._making_puller is None:
            self._making_puller = asyncio.ensure_future(self._make_puller())

    async def puller(self) -> KvPuller:
        self.start_puller()
        return await asyncio.shield(self._making_puller)

    async def _make_puller(self) -> KvPuller:
        device = (await self.engine.facts()).kv_device
        blocks = await self.engine.kv_blocks()  # cuda_ipc copies straight into its blocks
        return await asyncio.to_thread(KvPuller, self.channels, device, self.accepted, self._count_fallback, blocks,
                                       self._record_probe, releases=self.releases)

    def _record_probe(self, peer: str, transport: str, gbps: float) -> None:
        if self.metrics is not None:
            self.metrics.get("disagg_kv_probe_gbps", peer=peer, backend=transport).set(gbps)

    def _count_fallback(self, transport: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.get("disagg_kv_pull_fallbacks_total", backend=transport).inc()

    async def close(self) -> None:
        if self._making_puller is not None:
            (puller,) = await asyncio.gather(self._making_puller, return_exceptions=True)
            if isinstance(puller, KvPuller):
                await puller.close()
        if self.exporter is not None:
            self.exporter.close()
        await super().close()


class EngineTransport(KvPath):
    """A transport its engine drives itself, named by an OwnKvTransport engine (`kv_transport`). Nothing goes through
    TensorStore.Pull: the exporter's ref carries the engine's own import state (Engine.session_attributes) and no block
    ids; the importer's engine rebuilds its kv_import from them (kv_import_from_attributes) and fetches the KV.
    Refs name it by its own TransferBackend (its row's `number`, common.kv.transport)."""

    name: str  # its row's; one registered from outside also declares its TransferBackend `number`
    driven_by_engine = True

    def __init__(self, engine: OwnKvTransport, engine_name: str, layout: KvLayout | None = None) -> None:
        super().__init__(engine, engine_name, layout)

    def carries(self, transfer_backend: int) -> bool:
        return transfer_backend == transport.number_of(self.name)

    def transfer_backends(self) -> list[int]:
        return [transport.number_of(self.name)]

    async def ref_fields(self, session_id: str) -> tuple[int, dict[str, str]]:
        return transport.number_of(self.name), await self.engine.session_attributes(session_id)

    async def export(self, handle: str, block_ids: Sequence[int]) -> tuple[worker_pb2.TensorHeader, memoryview]:
        raise TransportUnavailable(f"the KV of session {handle} moves through this worker's engine ({self.name}), "
                                 "not TensorStore.Pull")

    def share(self, name: str) -> worker_pb2.KvCacheShare:
        raise TransportUnavailable("this worker exports no KV cache")

    def check_ref(self, ref: common_pb2.KvSessionRef) -> None:
        if not ref.session_id or not ref.endpoint:
            raise InvalidRequest("the KV session ref needs a session_id and an endpoint (its release goes there)")

    def engine_import(self, ref: common_pb2.KvSessionRef) -> KvImport:
        return self.engine.kv_import_from_attributes(ref.attributes)

    async def import_kv(self, ref: common_pb2.KvSessionRef, timeout_s: float | None) -> PulledKv:
        raise FailedPrecondition(f"the KV of session {ref.session_id} is fetched by this worker's engine "
                                 f"({self.name}) from the ref's attributes (engine_import), not pulled")


def check_pullable(ref: common_pb2.KvSessionRef) -> None:
    """Refuse a ref the data plane cannot pull, before any bytes move."""
    if not transport.pullable(ref.transfer_backend):
        name = common_pb2.TransferBackend.Name(ref.transfer_backend) if ref.transfer_backend in \
            common_pb2.TransferBackend.values() else str(ref.transfer_backend)
        pulled = ", ".join(map(common_pb2.TransferBackend.Name, transport.pulled_numbers()))
        raise InvalidRequest(f"KV transport {name} is not supported here; this worker pulls over {pulled}")
    if not ref.session_id or not ref.endpoint:
        raise InvalidRequest("the KV session ref needs a session_id and an endpoint")
    num_blocks = -(-ref.num_tokens // ref.block_size) if ref.block_size else -1
    if num_blocks != len(ref.block_ids):
        raise InvalidRequest(f"the KV session ref lists {len(ref.block_ids)} blocks for {ref.num_tokens} tokens "
                             f"of block size {ref.block_size}")


async def open_path(engine: Engine, exports: bool, accepted: tuple[str, ...], worker_id: str,
                    metrics: Metrics | None = None) -> KvPath:
    """The worker's KvPath; a data plane exporter (`exports`: prefill) shares its engine's cache with importers."""
    facts = await engine.facts()
    name, layout = facts.name, facts.kv_layout
    if isinstance(engine, OwnKvTransport):
        return transport.engine_transport(engine.kv_transport, engine, name, layout)
    if not isinstance(engine, KvSessionHost):
        raise InvalidConfig(f"--engine {name} neither hosts KV sessions for the KV data plane nor moves KV itself")
    exporter = None
    blocks = await engine.kv_blocks()
    if metrics is not None and blocks.tier_metrics is not None:  # the KV cache tiers below its pool count here
        blocks.tier_metrics.bind(metrics)
    if exports:
        exporter = KvCacheExporter(blocks.cache, accepted, worker_id, blocks.count_reuse)
    else:  # an importer: what its transports' first pulls would otherwise do (cuda_ipc: compile its copy kernel)
        for accepted_name in accepted:
            await asyncio.to_thread(transport.class_of(accepted_name).prepare_import, blocks.cache)
    plane = DataPlane(name, accepted, exporter, engine=engine, layout=layout, metrics=metrics)
    if exporter is None:
        plane.start_puller()  # in the background from now, not at the first pull
    return plane

"""Under the request path: the router's view of its workers (WorkerPool): one client per endpoint, kept in step with
discovery, and their KV events."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Coroutine, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import channels
from common.discovery import Discovery, Role
from common.errors import Unavailable
from common.pb.disagg.v1 import worker_pb2, worker_pb2_grpc
from services.router.kv_index import KvIndex
from services.router.decode_mux import DecodeMux
from services.router.generation import ServedModel
from services.kit.serving import channel_options

log = logging.getLogger(__name__)

_ACCEPTED_ROLES = {
    Role.PREFILL: {worker_pb2.WORKER_ROLE_PREFILL},
    Role.DECODE: {worker_pb2.WORKER_ROLE_DECODE, worker_pb2.WORKER_ROLE_AGGREGATED},
    Role.ENCODE: {worker_pb2.WORKER_ROLE_ENCODE},
}
_KV_ROLES = (Role.PREFILL, Role.DECODE)  # encode workers hold no KV
_GET_INFO_TIMEOUT_S = 5.0
_MAX_RETRY_S = 5.0
_SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(eq=False)
class WorkerClient:
    role: Role
    endpoint: str
    channel: grpc.aio.Channel
    info: worker_pb2.WorkerInfo | None = None
    healthy: bool = False  # answered GetInfo with the right role, and no request found it gone since
    serving: bool = False  # its grpc.health.v1 Watch says SERVING (a draining worker turns NOT_SERVING at once)
    health_watch: asyncio.Task | None = None
    # Requests this router has on the worker right now (a tie-breaker for least_loaded).
    inflight: int = 0
    # Uncached prompt tokens this router has sent the worker to prefill, not answered yet (kv_aware's load).
    pending_prefill_tokens: int = 0
    # Since when (wall clock) the worker has not been usable, and why: for the error a client gets.
    down_since: float = field(default_factory=time.time)
    down_reason: str = "has not answered GetInfo yet"
    worker: worker_pb2_grpc.WorkerStub = field(init=False)
    prefiller: worker_pb2_grpc.PrefillerStub = field(init=False)
    decoder: worker_pb2_grpc.DecoderStub = field(init=False)
    encoder: worker_pb2_grpc.EncoderStub = field(init=False)
    decode_mux: DecodeMux = field(init=False)  # Decoder.DecodeMany, opened on first use

    def __post_init__(self) -> None:
        self.worker = worker_pb2_grpc.WorkerStub(self.channel)
        self.prefiller = worker_pb2_grpc.PrefillerStub(self.channel)
        self.decoder = worker_pb2_grpc.DecoderStub(self.channel)
        self.encoder = worker_pb2_grpc.EncoderStub(self.channel)
        self.decode_mux = DecodeMux(self.decoder, self.endpoint)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    @property
    def usable(self) -> bool:
        return self.healthy and self.serving

    @contextlib.contextmanager
    def prefilling(self, num_tokens: int) -> Iterator[None]:
        self.pending_prefill_tokens += num_tokens
        try:
            yield
        finally:
            self.pending_prefill_tokens -= num_tokens

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1


class WorkerPool:
    """Follows discovery per role; a worker is usable once it has answered GetInfo with the right role, and while
    its health Watch (server-pushed, followed from then on) says SERVING.

    A draining worker turns NOT_SERVING: it is picked no more at once, but stays known, so requests in flight
    and releases still reach it. A worker that fails with UNAVAILABLE is set aside (`mark_down`) and probed with
    GetInfo until it answers again. `settled` is False while a newly discovered worker has not answered yet
    (within `contact_timeout_s`), so the router does not report SERVING with half its workers.

    With a `kv_index` (kv_aware routing) the pool owns the KV-event subscriptions: a prefill or decode
    worker that becomes ready is followed (KvIndex.follow), one that leaves discovery is unfollowed.
    """

    def __init__(self, discovery: Discovery, contact_timeout_s: float = 60.0, retry_s: float = 0.2,
                 kv_index: KvIndex | None = None):
        self._discovery = discovery
        self.kv_index = kv_index
        self._contact_timeout_s = contact_timeout_s
        self._retry_s = retry_s
        self._clients: dict[Role, dict[str, WorkerClient]] = {role: {} for role in _ACCEPTED_ROLES}
        self._pending: set[WorkerClient] = set()
        self._stores: dict[str, worker_pb2_grpc.TensorStoreStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        for role in _ACCEPTED_ROLES:
            self.spawn(self._follow(role))

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """Run a background task the pool owns (cancelled on close)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def ready(self, role: Role) -> list[WorkerClient]:
        return [c for c in self._clients[role].values() if c.usable]

    @property
    def settled(self) -> bool:
        return not self._pending

    def model(self) -> ServedModel:
        """Name and context length as the ready workers announce them (the smallest context wins);
        Unavailable, naming each decode worker that is down and since when, while none is ready."""
        decoders = self.ready(Role.DECODE)
        if not decoders:
            raise Unavailable(f"no decode worker is ready; the router cannot serve yet: {self._describe_down(Role.DECODE)}")
        infos = [c.info for role in (Role.PREFILL, Role.DECODE) for c in self.ready(role) if c.info is not None]
        return ServedModel(name=decoders[0].info.model, max_model_len=min(i.max_model_len for i in infos))

    def _describe_down(self, role: Role) -> str:
        clients = list(self._clients[role].values())
        if not clients:
            return f"discovery lists no {role.value} worker"
        now = time.time()
        return "; ".join(f"{role.value} worker {c.endpoint} {c.down_reason} since "
                         f"{time.strftime('%H:%M:%S', time.localtime(c.down_since))} ({now - c.down_since:.0f}s ago)"
                         for c in clients)

    def tensor_store(self, endpoint: str) -> worker_pb2_grpc.TensorStoreStub:
        if endpoint not in self._stores:
            self._stores[endpoint] = worker_pb2_grpc.TensorStoreStub(self._channel(endpoint))
        return self._stores[endpoint]

    def mark_down(self, client: WorkerClient, reason: str) -> None:
        """A request found the worker UNAVAILABLE. One whose health already says NOT_SERVING (draining) was
        expected to refuse: its health watch says when it serves again."""
        if client.healthy and client.serving:
            client.healthy = False
            client.down_since, client.down_reason = time.time(), f"is down ({reason})"
            log.warning("%s worker %s is down (%s); probing it until it answers", client.role.value,
                        client.endpoint, reason)
            self.spawn(self._contact(client))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.kv_index is not None:
            await self.kv_index.close()
        for client in (c for clients in self._clients.values() for c in clients.values()):
            client.decode_mux.close()
        await asyncio.gather(*(ch.close() for ch in self._channels), return_exceptions=True)

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        channel = channels.aio_channel(endpoint, options=channel_options())
        self._channels.append(channel)
        return channel

    async def _follow(self, role: Role) -> None:
        async for endpoints in self._discovery.watch(role):
            self._apply(role, endpoints)

    def _apply(self, role: Role, endpoints: list[str]) -> None:
        current = self._clients[role]
        for endpoint in endpoints:
            if endpoint not in current:
                client = current[endpoint] = WorkerClient(role, endpoint, self._channel(endpoint))
                self._pending.add(client)
                self.spawn(self._contact(client))
        for endpoint in set(current) - set(endpoints):
            client = current.pop(endpoint)
            client.healthy = False
            if client.health_watch is not None:
                client.health_watch.cancel()
            self._pending.discard(client)
            log.info("%s worker %s left discovery", role.value, endpoint)
            if self.kv_index is not None and role in _KV_ROLES and not any(
                    endpoint in self._clients[r] for r in _KV_ROLES):
                self.kv_index.unfollow(endpoint)

    async def _contact(self, client: WorkerClient) -> None:
        """GetInfo until the worker answers or leaves discovery."""
        loop = asyncio.get_running_loop()
        started, delay = loop.time(), self._retry_s
        while self._clients[client.role].get(client.endpoint) is client:
            try:
                info = await client.worker.GetInfo(worker_pb2.GetInfoRequest(), timeout=_GET_INFO_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                if client in self._pending and loop.time() - started > self._contact_timeout_s:
                    log.warning("%s worker %s did not answer GetInfo within %.0fs (%s); serving without it",
                                client.role.value, client.endpoint, self._contact_timeout_s, exc.code().name)
                    self._pending.discard(client)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_RETRY_S)
                continue
            self._admit(client, info)
            return

    def _admit(self, client: WorkerClient, info: worker_pb2.WorkerInfo) -> None:
        self._pending.discard(client)
        if info.role not in _ACCEPTED_ROLES[client.role]:
            log.error("worker %s is listed as %s but serves role %s; not using it", client.endpoint,
                      client.role.value, worker_pb2.WorkerRole.Name(info.role))
            return
        kv_roles = [] if client.role is Role.ENCODE else [client.role, Role.DECODE if client.role is Role.PREFILL
                                                         else Role.PREFILL]  # encode holds no KV
        for other in [c for role in kv_roles for c in self._clients[role].values() if c.healthy]:  # info known
            if other is not client and other.info.fingerprint != info.fingerprint:
                log.warning("%s worker %s serves fingerprint %s (model %s) but %s worker %s serves %s (model %s); "
                            "their KV is not interchangeable", client.role.value, client.endpoint, info.fingerprint,
                            info.model, other.role.value, other.endpoint, other.info.fingerprint, other.info.model)
        client.info, client.healthy = info, True
        if not client.serving:
            client.down_reason = "has not reported SERVING on its health watch yet"
        if client.health_watch is None:
            client.health_watch = self.spawn(self._watch_health(client))
        if self.kv_index is not None and client.role in _KV_ROLES:
            self.kv_index.follow(client)
        log.info("%s worker %s ready: model=%s fingerprint=%s max_model_len=%d", client.role.value, client.endpoint,
                 info.model, info.fingerprint, info.max_model_len)

    async def _watch_health(self, client: WorkerClient) -> None:
        """Follow the worker's health until it leaves discovery; a broken watch is opened again (with back-off)."""
        delay = self._retry_s
        while self._clients[client.role].get(client.endpoint) is client:
            try:
                async for response in client.health.Watch(health_pb2.HealthCheckRequest()):
                    self._set_serving(client, response.status == _SERVING,
                                      health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
                    delay = self._retry_s
                reason = "its health watch ended"  # the worker stopped
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.UNIMPLEMENTED:  # no health service: GetInfo and errors alone say
                    self._set_serving(client, True, "")
                    return
                reason = f"its health watch failed: {exc.code().name}"
            self._set_serving(client, False, reason)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_RETRY_S)

    def _set_serving(self, client: WorkerClient, serving: bool, status: str) -> None:
        if serving == client.serving:
            return
        client.serving = serving
        if serving:
            log.info("%s worker %s is SERVING", client.role.value, client.endpoint)
        else:
            client.down_since, client.down_reason = time.time(), f"is not serving ({status})"
            log.info("%s worker %s is not serving (%s); no new requests go to it", client.role.value,
                     client.endpoint, status)

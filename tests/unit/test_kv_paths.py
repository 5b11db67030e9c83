"""A worker's KvPath is picked by what its engine can do, never by its name (issue #25): an engine that moves KV
itself gets the transport it names, from the registry (TensorRT-LLM's `trtllm`, or one registered from outside);
one that hosts KV sessions gets our data plane, sharing its cache only where it exports. A ref whose KV moves
another way is FAILED_PRECONDITION naming both sides, whichever way round."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from common.engine.interface import KvBlocks, KvSessionHost, OwnKvTransport
from common.errors import FailedPrecondition, InvalidConfig, InvalidRequest, NotFound
from common.kv import transport
from common.kv.errors import TransportUnavailable
from common.kv.offer import OFFERED_ATTRIBUTE, parse_transports
from common.kv.paths import DataPlane, EngineTransport, open_path
from common.kv.transports.trtllm import TrtLlmTransport
from common.pb.disagg.v1 import common_pb2

ECHO_NUMBER = 99  # a TransferBackend the enum lacks: refs still carry it (proto3 enums are open)


class _Facts:
    def __init__(self, name: str):
        self.name = name

    async def facts(self) -> SimpleNamespace:
        return SimpleNamespace(name=self.name, kv_layout=None, kv_device=torch.device("cpu"))


class _OwnTransportEngine(_Facts):
    """An OwnKvTransport: its kv_import is the ref's attributes, and it remembers what it was asked."""

    def __init__(self, kv_transport: str = "trtllm", name: str = "trtllm"):
        super().__init__(name)
        self.kv_transport = kv_transport
        self.asked: list[str] = []

    async def session_attributes(self, session_id: str) -> dict[str, str]:
        self.asked.append(session_id)
        return {"trtllm.first_gen_tokens": "7"}

    def kv_import_from_attributes(self, attributes) -> tuple:
        return ("kv_import", dict(attributes))


class _SessionHostEngine(_Facts):
    """A KvSessionHost whose session_attributes must never be asked for: the data plane adds its own."""

    def __init__(self):
        super().__init__("torch")
        self.cache = torch.zeros(2, 2, 8, 4, 1, 4)

    async def lease_session(self, session_id, block_ids=()):
        return list(block_ids)

    async def end_lease(self, session_id):
        pass

    async def kv_cache(self):
        return self.cache

    async def kv_blocks(self) -> KvBlocks:
        return KvBlocks(self.cache, lambda n: None, lambda ids: None, lambda epochs: None)

    async def session_attributes(self, session_id):
        raise AssertionError("the data plane's ref needs no trip to the engine")


class EchoTransport(EngineTransport):
    name = "echo"
    number = ECHO_NUMBER
    moves = "through the echo engine's own link"


@pytest.fixture
def echo():
    transport.register(EchoTransport)
    try:
        yield EchoTransport
    finally:
        transport.unregister(EchoTransport.name)


def _ref(session_id: str, transfer_backend: int, **fields) -> common_pb2.KvSessionRef:
    return common_pb2.KvSessionRef(session_id=session_id, endpoint="127.0.0.1:1", transfer_backend=transfer_backend,
                                   **fields)


def test_an_engine_that_moves_kv_itself_gets_the_trtllm_transport_from_the_registry():
    engine = _OwnTransportEngine()
    assert isinstance(engine, OwnKvTransport) and not isinstance(engine, KvSessionHost)
    path = asyncio.run(open_path(engine, True, parse_transports("auto"), "w1"))
    assert isinstance(path, TrtLlmTransport) and path.engine is engine and path.engine_name == "trtllm"
    assert path.transfer_backends() == [common_pb2.TRANSFER_BACKEND_TRTLLM]
    assert asyncio.run(path.ref_fields("s1")) == (common_pb2.TRANSFER_BACKEND_TRTLLM, {"trtllm.first_gen_tokens": "7"})
    assert engine.asked == ["s1"]
    ref = _ref("s1", common_pb2.TRANSFER_BACKEND_TRTLLM, attributes={"trtllm.first_gen_tokens": "7"})
    path.check(ref)
    assert path.engine_import(ref) == ("kv_import", {"trtllm.first_gen_tokens": "7"})  # the engine fetches the KV itself
    with pytest.raises(TransportUnavailable, match=r"moves through this worker's engine \(trtllm\), not TensorStore"):
        asyncio.run(path.export("s1", []))
    with pytest.raises(TransportUnavailable, match="exports no KV cache"):
        path.share("cuda_ipc")
    with pytest.raises(InvalidRequest, match="session_id and an endpoint"):
        path.check(common_pb2.KvSessionRef(session_id="s1", transfer_backend=common_pb2.TRANSFER_BACKEND_TRTLLM))


def test_a_kv_session_host_gets_the_data_plane_sharing_its_cache_only_where_it_exports():
    engine = _SessionHostEngine()
    assert isinstance(engine, KvSessionHost) and not isinstance(engine, OwnKvTransport)
    exporter_path = asyncio.run(open_path(engine, True, ("shm", "grpc"), "w1"))
    importer_path = asyncio.run(open_path(engine, False, ("grpc",), "w2"))
    try:
        assert isinstance(exporter_path, DataPlane) and exporter_path.exporter.kv_cache is engine.cache
        offered = exporter_path.exporter.offered
        assert exporter_path.transfer_backends() == [transport.number_of(n) for n in offered]
        number, attributes = asyncio.run(exporter_path.ref_fields("s1"))
        assert number == exporter_path.exporter.best_transport and attributes[OFFERED_ATTRIBUTE] == ",".join(offered)
        assert isinstance(importer_path, DataPlane) and importer_path.exporter is None
        assert importer_path.transfer_backends() == [common_pb2.TRANSFER_BACKEND_GRPC]
        with pytest.raises(NotFound, match="exports no KV sessions"):
            asyncio.run(importer_path.export("s1", []))
        with pytest.raises(TransportUnavailable, match="exports no KV cache"):
            importer_path.share("grpc")
        ref = _ref("s1", common_pb2.TRANSFER_BACKEND_GRPC, num_tokens=5, block_size=4, block_ids=[3, 4])
        importer_path.check(ref)
        assert importer_path.engine_import(ref) is None  # pulled over the data plane
        with pytest.raises(InvalidRequest, match="lists 1 blocks for 5 tokens"):
            importer_path.check(_ref("s1", common_pb2.TRANSFER_BACKEND_GRPC, num_tokens=5, block_size=4, block_ids=[3]))
    finally:
        asyncio.run(exporter_path.close())


def test_an_engine_with_neither_capability_is_refused_by_name():
    with pytest.raises(InvalidConfig, match="--engine mystery neither hosts KV sessions"):
        asyncio.run(open_path(_Facts("mystery"), False, ("grpc",), "w1"))


@pytest.mark.parametrize("number", [common_pb2.TRANSFER_BACKEND_GRPC, common_pb2.TRANSFER_BACKEND_CUDA_IPC])
def test_a_data_plane_ref_at_a_trtllm_worker_is_failed_precondition_naming_both_sides(number):
    path = asyncio.run(open_path(_OwnTransportEngine(), False, ("grpc",), "w1"))
    with pytest.raises(FailedPrecondition) as refused:
        path.check(_ref("s3", number))
    name = common_pb2.TransferBackend.Name(number)
    assert str(refused.value) == (
        f"KV session s3 was exported with transfer_backend {name}, to be moved over the KV data plane (TensorStore: "
        "cuda_ipc, shm, nixl, grpc), but this decode worker runs --engine trtllm, which imports KV only through "
        "TensorRT-LLM's cache transceiver (TRANSFER_BACKEND_TRTLLM); run prefill and decode workers with the same "
        "--engine")


def test_an_engine_transport_registered_from_outside_is_picked_for_the_engine_naming_it(echo):
    engine = _OwnTransportEngine(kv_transport="echo", name="echo-engine")
    path = asyncio.run(open_path(engine, True, ("grpc",), "w1"))
    assert isinstance(path, echo) and path.transfer_backends() == [ECHO_NUMBER]
    assert transport.number_of("echo") == ECHO_NUMBER
    assert transport.names() == ("cuda_ipc", "shm", "nixl", "grpc")  # not a data plane choice
    with pytest.raises(InvalidConfig, match="unknown transport"):
        parse_transports("echo")
    with pytest.raises(FailedPrecondition) as refused:  # its ref at a data plane worker
        DataPlane("torch", ("grpc",)).check(_ref("s4", ECHO_NUMBER))
    assert "transfer_backend 99, to be moved through the echo engine's own link" in str(refused.value)
    with pytest.raises(FailedPrecondition, match="through TensorRT-LLM's cache transceiver"):  # a trtllm ref at it
        path.check(_ref("s5", common_pb2.TRANSFER_BACKEND_TRTLLM))


def test_an_engine_transport_needs_its_own_transfer_backend_number():
    class Nameless(EngineTransport):
        name = "nameless"
        number = common_pb2.TRANSFER_BACKEND_UNSPECIFIED
        moves = "somehow"

    with pytest.raises(InvalidConfig, match="needs a TransferBackend number"):
        transport.register(Nameless)
    with pytest.raises(InvalidConfig, match="built-in"):
        transport.unregister("trtllm")


def test_an_importer_negotiates_its_transports_in_the_background_off_the_event_loop(monkeypatch):
    """Which transports can run here is a slow check (NIXL's makes an agent: 0.45 s). Made at the first pull, on the
    event loop, it held that handoff and every other stream of the decode worker for as long."""
    checked_on = []
    real_create = transport.create

    def create(name: str):
        made = real_create(name)
        reason = made.unavailable_reason
        made.unavailable_reason = lambda device: checked_on.append(threading.current_thread()) or reason(device)
        return made

    monkeypatch.setattr(transport, "create", create)

    async def open_and_pull_twice() -> None:
        path = await open_path(_SessionHostEngine(), False, ("shm", "grpc"), "w2")
        try:
            assert path._making_puller is not None  # started as the path opened, before any pull
            puller = await path.puller()
            assert tuple(puller.transports) == ("shm", "grpc") and await path.puller() is puller  # made once
            assert checked_on and threading.current_thread() not in checked_on
        finally:
            await path.close()

    asyncio.run(open_and_pull_twice())

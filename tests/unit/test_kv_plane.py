"""The KV data plane's pieces that need no second process: export leases, transport offers and choice."""
import asyncio
import time

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import RequestType, SamplingParams
from common.errors import InvalidConfig, InvalidRequest
from common.kv import gather, host, transport
from common.kv.blocks import block_runs, gather_blocks
from common.kv.buffers import host_empty
from common.kv.errors import TransportUnavailable
from common.kv.offer import KV_CACHE_ID_ATTRIBUTE, OFFERED_ATTRIBUTE, parse_transports
from common.kv.probe import PROBE_BLOCKS, PROBE_HANDLE
from common.kv.pull import KvPuller
from common.kv.sharing import KvCacheExporter
from common.kv.wire import ChannelCache
from common.pb.disagg.v1 import common_pb2

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _session(engine: LLMEngine, prompt: list[int]) -> str:
    engine.add_request("p", prompt, GREEDY, RequestType.CONTEXT_ONLY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs[-1].session_id


@pytest.fixture
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=32))


def test_release_during_an_export_frees_the_blocks_when_the_lease_ends(engine):
    session_id = _session(engine, list(range(10, 27)))  # 17 tokens: 5 blocks
    assert engine.block_manager.num_free_blocks == 27
    ids = engine.lease_session(session_id)
    assert len(ids) == 5
    engine.release_session(session_id)  # the importer released while the gather still reads
    assert engine.block_manager.num_free_blocks == 27 and engine.num_leased_released == 1
    engine.end_lease(session_id)
    assert engine.block_manager.num_free_blocks == 32 and engine.num_leased_released == 0
    engine.end_lease(session_id)  # a second end is harmless
    assert engine.block_manager.num_free_blocks == 32


def test_a_leased_session_outlives_its_ttl_until_the_export_ends(engine):
    session_id = _session(engine, list(range(10, 20)))
    engine.lease_session(session_id)
    engine.sessions.sessions[session_id].expires_at = 0.0
    assert engine.expire_sessions() == 0
    engine.end_lease(session_id)
    assert engine.expire_sessions() == 1
    assert engine.block_manager.num_free_blocks == 32


def test_a_lease_of_foreign_block_ids_is_refused(engine):
    session_id = _session(engine, list(range(10, 20)))
    with pytest.raises(InvalidRequest, match="are not in KV session"):
        engine.lease_session(session_id, [31])
    assert engine.sessions.sessions[session_id].leases == 0


def test_gather_to_host_equals_index_select(engine):
    session_id = _session(engine, list(range(10, 27)))
    ids = engine.lease_session(session_id)
    blocks = asyncio.run(gather.gather_to_host(engine.kv_cache, ids))
    assert torch.equal(blocks, engine.export_session(session_id).blocks)
    engine.end_lease(session_id)


def test_transport_lists_keep_preference_order_and_grpc():
    assert parse_transports("auto") == ("cuda_ipc", "shm", "nixl", "grpc")
    assert parse_transports("grpc,shm") == ("shm", "grpc")
    assert parse_transports("cuda_ipc") == ("cuda_ipc", "grpc")
    with pytest.raises(InvalidConfig, match="unknown transport.*'rdma'"):
        parse_transports("rdma,grpc")


def test_a_cpu_exporter_offers_no_cuda_ipc_and_says_what_it_offers(engine):
    exporter = KvCacheExporter(engine.kv_cache, parse_transports("cuda_ipc,shm,grpc"), "w1")
    assert exporter.offered == (["shm", "grpc"] if host.host_id() else ["grpc"])
    attributes = exporter.attributes()
    assert attributes[OFFERED_ATTRIBUTE] == ",".join(exporter.offered)
    assert attributes[KV_CACHE_ID_ATTRIBUTE].startswith("w1-")
    with pytest.raises(TransportUnavailable, match="does not offer cuda_ipc: the KV cache is in host memory"):
        exporter.share("cuda_ipc")


def _ref(offer: str, **attributes) -> common_pb2.KvSessionRef:
    return common_pb2.KvSessionRef(session_id="s", endpoint="127.0.0.1:1", transfer_backend=common_pb2.TRANSFER_BACKEND_SHM,
                                   attributes={OFFERED_ATTRIBUTE: offer, **attributes})


def test_the_importer_takes_offered_transports_it_can_use_with_grpc_last():
    puller = KvPuller(ChannelCache(), torch.device("cpu"), parse_transports("auto"))
    here = {host.HOST_ID_ATTRIBUTE: host.host_id()}
    # No GPU here: cuda_ipc is never tried; shm only for an exporter on this host.
    assert puller.candidates(_ref("cuda_ipc,shm,grpc", **here, cuda_device_uuid="GPU-x")) == \
        (["shm", "grpc"] if host.host_id() else ["grpc"])
    assert puller.candidates(_ref("shm,grpc", host_id="another-host")) == ["grpc"]
    assert puller.candidates(_ref("grpc")) == ["grpc"]
    grpc_only = KvPuller(ChannelCache(), torch.device("cpu"), parse_transports("grpc"))
    assert grpc_only.candidates(_ref("shm,grpc", **here)) == ["grpc"]


def test_a_transport_that_failed_for_a_peer_is_skipped_logged_once_and_counted(caplog):
    failures = []
    puller = KvPuller(ChannelCache(), torch.device("cpu"), parse_transports("auto"),
                      on_fallback=lambda transport, reason: failures.append(transport))
    ref = _ref("shm,grpc", host_id=host.host_id())
    if not host.host_id():
        pytest.skip("no /dev/shm host id here")
    for _ in range(2):
        puller.fall_back(ref.endpoint, "shm", "the exporter cannot open the file")
    assert puller.candidates(ref) == ["grpc"]
    assert failures == ["shm", "shm"]
    warnings = [r for r in caplog.records if "KV transport shm unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "cannot open the file" in warnings[0].getMessage()


def test_block_runs_split_ids_into_consecutive_runs():
    assert block_runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert block_runs([]) == []


@pytest.mark.parametrize("block_ids", [[3, 4, 5, 6], [7, 1, 2, 9, 0], list(range(40, 0, -2))])
def test_gather_blocks_equals_index_select_for_runs_and_scattered_ids(block_ids):
    cache = torch.randn(3, 2, 48, 4, 2, 8)
    expected = cache.index_select(2, torch.tensor(block_ids))
    assert torch.equal(gather_blocks(cache, block_ids), expected)
    into = []  # the output's memory from `allocate`: the same values, in the buffer handed out
    out = gather_blocks(cache, block_ids, lambda n: into.append(host_empty(n)) or into[-1])
    assert torch.equal(out, expected) and out.data_ptr() == into[0].data_ptr()


def test_a_pull_cancelled_while_its_lease_is_answered_still_ends_the_lease(tiny_llama):
    from common.engine.async_engine import AsyncLLMEngine
    from common.kv.paths import DataPlane

    async def scenario() -> int:
        engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=32)))
        try:
            session_id = await engine.call(lambda e: _session(e, list(range(10, 27))))
            layout, cache = (await engine.facts()).kv_layout, await engine.kv_cache()
            source = DataPlane("torch", ("grpc",), KvCacheExporter(cache, ("grpc",)), engine=engine, layout=layout)
            lease, answered = engine.lease_session, asyncio.Event()

            async def late_lease(handle, block_ids):  # taken on the engine thread, answered late
                taken = await lease(handle, block_ids)
                await answered.wait()
                return taken

            engine.lease_session = late_lease
            pull = asyncio.ensure_future(source.export(session_id, []))
            await asyncio.sleep(0.2)
            pull.cancel()  # the puller went away before the lease's answer
            answered.set()
            with pytest.raises(asyncio.CancelledError):
                await pull
            await asyncio.sleep(0.2)
            return await engine.call(lambda e: e.sessions.sessions[session_id].leases)
        finally:
            engine.shutdown()

    assert asyncio.run(scenario()) == 0


def test_a_transport_failing_its_self_check_is_a_warning_naming_the_fallback_and_is_skipped(caplog, monkeypatch):
    if not host.host_id():
        pytest.skip("no /dev/shm host id here")
    figures, failures = [], []
    puller = KvPuller(ChannelCache(), torch.device("cpu"), parse_transports("auto"),
                      on_fallback=lambda transport, reason: failures.append(transport),
                      on_probe=lambda peer, transport, gbps: figures.append((transport, gbps)))

    async def pull_gbps(channel, probe, transport):
        assert probe.session_id == PROBE_HANDLE and list(probe.block_ids) == list(range(PROBE_BLOCKS))
        if transport == "shm":
            raise TransportUnavailable("the exporter cannot open the file")
        return 1.5

    monkeypatch.setattr(puller.self_check, "_gbps", pull_gbps)
    ref = _ref("shm,grpc", host_id=host.host_id())
    asyncio.run(puller.self_check.run(None, ref))
    assert figures == [("shm", 0.0), ("grpc", 1.5)] and failures == ["shm"]
    assert puller.candidates(ref) == ["grpc"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("shm unavailable" in w and "cannot open the file" in w for w in warnings), warnings
    assert any("fall back to grpc (1.50 GB/s" in w for w in warnings), warnings



@pytest.mark.parametrize("offer, failing, tried", [
    ("shm,nixl,grpc", set(), ["shm", "grpc"]),  # shm works: nixl would start an agent and a thread for nothing
    ("shm,nixl,grpc", {"shm"}, ["shm", "nixl", "grpc"]),
    ("nixl,grpc", set(), ["nixl", "grpc"]),  # nixl is what pulls will take: tried
])
def test_the_self_check_tries_nixl_only_where_no_better_transport_works(monkeypatch, offer, failing, tried):
    """NIXL's agents (and the exporter's progress thread) start on first use and then keep running; the self-check
    must not start them where pulls go over a better transport."""
    if not host.host_id():
        pytest.skip("no /dev/shm host id here")
    puller = KvPuller(ChannelCache(), torch.device("cpu"), parse_transports("auto"))
    puller.transports.setdefault("nixl", transport.create("nixl"))  # made without starting anything, NIXL or not
    probed = []

    async def pull_gbps(channel, probe, transport):
        probed.append(transport)
        if transport in failing:
            raise TransportUnavailable("broken here")
        return 1.0

    monkeypatch.setattr(puller.self_check, "_gbps", pull_gbps)
    asyncio.run(puller.self_check.run(None, _ref(offer, host_id=host.host_id())))
    assert probed == tried


class _Event:
    """A CUDA event's stand-in, done after `done_after_s` (never: None); synchronize blocks until then (or 0.3 s)."""

    def __init__(self, done_after_s: float | None):
        self._at = None if done_after_s is None else time.perf_counter() + done_after_s

    def query(self) -> bool:
        return self._at is not None and time.perf_counter() >= self._at

    def synchronize(self) -> None:
        time.sleep(0.3 if self._at is None else max(self._at - time.perf_counter(), 0))


@pytest.mark.parametrize("spin_s", [10.0, 0.001])  # the copy awaited by polling, or in a worker thread
def test_waiting_for_a_kv_copy_keeps_its_own_deadline(spin_s):
    async def wait(event: _Event, timeout_s: float) -> float:
        start = time.perf_counter()
        await gather.wait_event(event, timeout_s, spin_s=spin_s)
        return time.perf_counter() - start

    assert asyncio.run(wait(_Event(0.01), 5.0)) < 1.0
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(wait(_Event(None), 0.05))

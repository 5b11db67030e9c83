"""The KV transport registry: built-ins by name, loaded only when used; a transport from outside the core
(tests/integration/fake_kv_transport.py) registered, offered by the exporter with its generic share, and
negotiated by the importer; a module named in DISAGG_KV_TRANSPORT_MODULES registered before the first lookup."""
import asyncio
import importlib
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from common.errors import InvalidConfig
from common.kv import transport
from common.kv.offer import OFFERED_ATTRIBUTE, parse_transports
from common.kv.pull import KvPuller
from common.kv.sharing import KvCacheExporter
from common.kv.wire import ChannelCache
from common.pb.disagg.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[2]
FAKE_MODULE = "tests.integration.fake_kv_transport"


@pytest.fixture
def fake():
    """The fake registered (importing it registers it) for one test only."""
    module = importlib.import_module(FAKE_MODULE)
    transport.register(module.FakeTransport)
    try:
        yield module
    finally:
        transport.unregister(module.NAME)


def test_the_built_in_transports_come_best_first_with_grpc_last():
    assert transport.names() == ("cuda_ipc", "shm", "nixl", "grpc")
    assert [transport.number_of(n) for n in transport.names()] == [
        common_pb2.TRANSFER_BACKEND_CUDA_IPC, common_pb2.TRANSFER_BACKEND_SHM, common_pb2.TRANSFER_BACKEND_NIXL,
        common_pb2.TRANSFER_BACKEND_GRPC]


def test_an_unknown_transport_is_refused_with_the_known_ones_and_built_ins_stay():
    with pytest.raises(InvalidConfig, match=r"unknown KV transport 'rdma'; known: \['cuda_ipc'"):
        transport.create("rdma")
    with pytest.raises(InvalidConfig, match="built-in"):
        transport.unregister("grpc")


def test_a_registered_transport_is_offered_with_its_generic_share_and_negotiated(fake):
    chunk_bytes, fake = fake.CHUNK_BYTES, fake.NAME
    assert parse_transports(f"{fake},grpc") == (fake, "grpc")
    exporter = KvCacheExporter(torch.zeros(2, 2, 8, 4, 1, 4), parse_transports(f"{fake},grpc"), "w1")
    assert exporter.offered == [fake, "grpc"]
    assert exporter.best_transport == common_pb2.TRANSFER_BACKEND_UNSPECIFIED
    share = exporter.share(fake)
    assert (share.transport, dict(share.attributes), share.kv_cache_id) == \
        (fake, {"chunk_bytes": str(chunk_bytes)}, exporter.kv_cache_id)
    puller = KvPuller(ChannelCache(), torch.device("cpu"), parse_transports("auto"), self_check=False)
    ref = common_pb2.KvSessionRef(session_id="s", endpoint="127.0.0.1:1", attributes=exporter.attributes())
    assert ref.attributes[OFFERED_ATTRIBUTE] == f"{fake},grpc"
    assert puller.candidates(ref) == [fake, "grpc"]


def test_transport_modules_are_imported_from_the_environment_and_built_ins_only_when_used():
    script = ("import json, sys; from common.kv import transport; names = transport.names(); "
              "print(json.dumps([names, 'common.kv.transports.nixl' in sys.modules]))")
    env = {**os.environ, transport.MODULES_ENV: FAKE_MODULE}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    names, nixl_loaded = json.loads(result.stdout)
    assert names == ["cuda_ipc", "shm", "nixl", "fake", "grpc"]
    assert not nixl_loaded


class _StartsOnFirstUse(transport.KvTransport):
    """Like nixl: its check alone is costly, and it cannot run here."""
    name = "agent-like"
    starts_on_first_use = True
    checked_on: list = []

    def unavailable_reason(self, device: torch.device) -> str | None:
        self.checked_on.append(threading.current_thread())
        return "no agent library here"

    async def pull(self, puller, channel, ref, timeout_s):
        raise AssertionError("never pulled through: it cannot run here")

    async def probe(self, puller, channel, probe):
        raise AssertionError("never probed: it cannot run here")


def test_a_transport_that_starts_on_first_use_is_checked_only_then_and_off_the_event_loop(caplog):
    """NIXL's check makes an agent (0.5 s of a core): every decode worker made it as its puller was made, though on
    one host its pulls take shm and never use it. It is checked at its first use now, in a thread."""
    transport.register(_StartsOnFirstUse)
    _StartsOnFirstUse.checked_on = []
    try:
        puller = KvPuller(ChannelCache(), torch.device("cpu"), ("agent-like", "grpc"), self_check=False)
        assert _StartsOnFirstUse.checked_on == [] and tuple(puller.transports) == ("agent-like", "grpc")

        async def use_thrice() -> tuple[bool, bool, bool, threading.Thread]:
            # a pull and the self-check at once, then a later pull: one check for all three
            first, second = await asyncio.gather(puller.usable("agent-like"), puller.usable("agent-like"))
            return first, second, await puller.usable("agent-like"), threading.current_thread()

        with caplog.at_level(logging.INFO, logger="common.kv.pull"):
            first, second, third, loop_thread = asyncio.run(use_thrice())
        assert (first, second, third) == (False, False, False)
        assert caplog.text.count("KV transport agent-like not used") == 1
        assert len(_StartsOnFirstUse.checked_on) == 1 and _StartsOnFirstUse.checked_on[0] is not loop_thread
        assert tuple(puller.transports) == ("grpc",)
        assert "KV transport agent-like not used by this worker: no agent library here" in caplog.text
        assert asyncio.run(puller.usable("grpc"))
    finally:
        transport.unregister(_StartsOnFirstUse.name)

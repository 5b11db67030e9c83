"""The NIXL KV data plane over DRAM: an exporter process publishes its caches, this process reads blocks."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from benchmarks.cpu_time import cores_used
from benchmarks.nixl_exporter import ExporterProcess, fill_cache
from common.errors import InvalidRequest, LayoutMismatch, Unavailable
from common.kv.transports.nixl.plane import (
    NixlCacheInfo,
    NixlImporter,
    TransferFailed,
    nixl_unavailable_reason,
    validate_read,
)

SHAPE = (3, 2, 16, 4, 2, 8)  # layers, k|v, blocks, block size, kv heads, head dim
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

needs_nixl = pytest.mark.skipif(nixl_unavailable_reason() is not None,
                                reason=f"NIXL cannot run here: {nixl_unavailable_reason()}")


@pytest.fixture(scope="module")
def exporter_process():
    process = ExporterProcess(SHAPE, DTYPES)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def importer():
    importer = NixlImporter()
    try:
        yield importer
    finally:
        importer.close()


def _count_calls(monkeypatch, target, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(target, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, counted)
    return calls


def _out(dtype: torch.dtype, num_blocks: int) -> torch.Tensor:
    return torch.zeros(SHAPE[0], 2, num_blocks, *SHAPE[3:], dtype=dtype)


def _info(**changes) -> NixlCacheInfo:
    info = NixlCacheInfo(agent_name="disagg-export-1-abc", agent_metadata=b"not a real agent", base_addr=4096,
                         num_layers=SHAPE[0], num_blocks=SHAPE[2], region_bytes=4 * 2 * 8 * 4,
                         mem_type="DRAM", device_id=0)
    return dataclasses.replace(info, **changes)


def test_cache_info_round_trips_through_plain_fields():
    info = _info()
    fields = info.to_fields()
    assert all(isinstance(value, (int, str, bytes)) for value in fields.values())
    assert NixlCacheInfo.from_fields(fields) == info


@pytest.mark.parametrize("changes", [{"mem_type": "HBM"}, {"num_blocks": 0}, {"agent_metadata": b""}])
def test_cache_info_from_fields_refuses_malformed_values(changes):
    with pytest.raises(InvalidRequest):
        NixlCacheInfo.from_fields({**_info().to_fields(), **changes})
    with pytest.raises(InvalidRequest, match="malformed"):
        NixlCacheInfo.from_fields({key: value for key, value in _info().to_fields().items() if key != "base_addr"})


def test_read_validation_refuses_layouts_that_do_not_fit():
    peer = _info()
    validate_read(peer, [0, 15], _out(torch.float32, 2))
    with pytest.raises(LayoutMismatch, match="layer count"):
        validate_read(dataclasses.replace(peer, num_layers=4), [0, 15], _out(torch.float32, 2))
    with pytest.raises(LayoutMismatch, match="bytes"):
        validate_read(peer, [0, 15], _out(torch.bfloat16, 2))
    with pytest.raises(LayoutMismatch, match=r"\[L, 2, 3"):
        validate_read(peer, [0, 1, 2], _out(torch.float32, 2))
    with pytest.raises(InvalidRequest, match="at least one"):
        validate_read(peer, [], _out(torch.float32, 0))


@needs_nixl
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("ids", [[13, 2, 7, 0, 15, 7], [4, 5, 6, 10, 11, 3, 15]], ids=["scattered", "runs"])
def test_read_blocks_copies_scattered_blocks_byte_for_byte(exporter_process, importer, dtype_name, ids):
    dtype = DTYPES[dtype_name]
    out = _out(dtype, len(ids))
    importer.read_blocks(exporter_process.infos[dtype_name], ids, out)
    expected = fill_cache(SHAPE, dtype)[:, :, ids]
    assert torch.equal(out.view(torch.uint8), expected.contiguous().view(torch.uint8))



@needs_nixl
def test_an_exporter_that_served_reads_spends_no_cpu_while_idle(exporter_process, importer):
    """Its progress thread waits on UCX's wakeup fd: nixl_agent's own setting polls at zero timeout, a whole core."""
    for _ in range(3):
        importer.read_blocks(exporter_process.infos["float32"], [1, 2, 5], _out(torch.float32, 3))
    time.sleep(0.2)
    used = cores_used([exporter_process.process.pid], 2.0)[exporter_process.process.pid]
    assert used < 0.05, f"the idle exporter used {used:.0%} of a core"

@needs_nixl
def test_async_reads_run_concurrently_on_one_event_loop(exporter_process, importer):
    reads = {name: ([3, 9, 4], _out(dtype, 3)) if name == "float32" else ([12, 13, 1], _out(dtype, 3))
             for name, dtype in DTYPES.items()}

    async def read_all() -> None:
        await asyncio.gather(*(importer.read_blocks_async(exporter_process.infos[name], ids, out)
                               for name, (ids, out) in reads.items()))

    asyncio.run(read_all())
    for name, (ids, out) in reads.items():
        assert torch.equal(out, fill_cache(SHAPE, DTYPES[name])[:, :, ids])


@needs_nixl
def test_repeated_reads_reuse_the_added_peer(exporter_process, importer, monkeypatch):
    adds = _count_calls(monkeypatch, importer._agent, "add_remote_agent")
    info = exporter_process.infos["float32"]
    for ids in ([1], [5, 6], [1]):
        importer.read_blocks(info, ids, _out(torch.float32, len(ids)))
    assert len(adds) == 1 and importer.peers() == [info.agent_name]
    importer.forget_peer(info.agent_name)
    importer.read_blocks(info, [8], _out(torch.float32, 1))
    assert len(adds) == 2


@needs_nixl
def test_changed_peer_metadata_replaces_the_added_peer(exporter_process, importer, monkeypatch):
    removes = _count_calls(monkeypatch, importer._agent, "remove_remote_agent")
    info = exporter_process.infos["float32"]
    importer.read_blocks(info, [1], _out(torch.float32, 1))
    with pytest.raises(TransferFailed, match="cannot add NIXL peer"):
        importer.read_blocks(dataclasses.replace(info, agent_metadata=b"garbled"), [1], _out(torch.float32, 1))
    assert len(removes) == 1 and importer.peers() == []
    out = _out(torch.float32, 1)
    importer.read_blocks(info, [1], out)
    assert torch.equal(out, fill_cache(SHAPE, torch.float32)[:, :, [1]])


@needs_nixl
def test_out_of_range_block_ids_are_refused_before_any_transfer(exporter_process, importer, monkeypatch):
    transfers = _count_calls(monkeypatch, importer._agent, "transfer")
    info = exporter_process.infos["float32"]
    for ids in ([0, SHAPE[2]], [-1]):
        with pytest.raises(InvalidRequest, match="outside the peer's cache of 16 blocks"):
            importer.read_blocks(info, ids, _out(torch.float32, len(ids)))
    assert transfers == [] and importer.peers() == []


@needs_nixl
def test_read_from_an_exporter_that_went_away_raises_transfer_failed(importer):
    process = ExporterProcess(SHAPE, DTYPES)
    try:
        connected, never_added = process.infos["float32"], process.infos["bfloat16"]
        importer.read_blocks(connected, [1], _out(torch.float32, 1))
    finally:
        process.kill()
    for info, dtype in ((connected, torch.float32), (never_added, torch.bfloat16)):
        started = time.monotonic()
        with pytest.raises(TransferFailed) as raised:
            importer.read_blocks(info, [1, 2], _out(dtype, 2), timeout_s=20)
        assert isinstance(raised.value, Unavailable) and info.agent_name in str(raised.value)
        assert time.monotonic() - started < 15, "a dead exporter must fail the read, not hang it"
    assert importer.peers() == []


def _stop_all_threads(pid: int) -> None:
    """SIGSTOP, and wait until every thread (UCX's progress thread too) is stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks]
        if all(state in "Tt" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop: thread states {states}")


@needs_nixl
def test_a_timed_out_read_keeps_its_target_alive_until_nixl_finishes_it(exporter_process, monkeypatch):
    """Over TCP a stopped exporter cannot answer; the read times out, and the bytes that arrive after
    the exporter resumes land in the target the importer kept, not in freed memory."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # cross-memory attach would not need the exporter to run
    importer, pid = NixlImporter(), exporter_process.process.pid
    try:
        info = exporter_process.infos["float32"]
        importer.read_blocks(info, [1], _out(torch.float32, 1))
        _stop_all_threads(pid)
        given_up = _out(torch.float32, 2)
        with pytest.raises(TransferFailed, match="timed out after 0.5 s"):
            importer.read_blocks(info, [4, 9], given_up, timeout_s=0.5)
        assert importer.reads_in_flight() == 1 and importer.peers() == [info.agent_name]
        os.kill(pid, signal.SIGCONT)
        out = _out(torch.float32, 2)
        importer.read_blocks(info, [9, 4], out)
        deadline = time.monotonic() + 10
        while importer.reads_in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        expected = fill_cache(SHAPE, torch.float32)
        assert importer.reads_in_flight() == 0
        assert torch.equal(given_up, expected[:, :, [4, 9]]) and torch.equal(out, expected[:, :, [9, 4]])
    finally:
        os.kill(pid, signal.SIGCONT)
        importer.close()


@needs_nixl
def test_a_cancelled_async_read_is_kept_until_nixl_finishes_it(exporter_process, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    importer, pid = NixlImporter(), exporter_process.process.pid
    try:
        info = exporter_process.infos["bfloat16"]
        importer.read_blocks(info, [1], _out(torch.bfloat16, 1))
        _stop_all_threads(pid)
        given_up = _out(torch.bfloat16, 3)

        async def cancel_mid_read() -> None:
            task = asyncio.create_task(importer.read_blocks_async(info, [2, 3, 14], given_up))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancel_mid_read())
        assert importer.reads_in_flight() == 1
        os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while importer.reads_in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert importer.reads_in_flight() == 0
        assert torch.equal(given_up, fill_cache(SHAPE, torch.bfloat16)[:, :, [2, 3, 14]])
    finally:
        os.kill(pid, signal.SIGCONT)
        importer.close()

"""The KV tiers' pieces (common.kv.tiers): a record round-trips and every check of it fails on what it guards; the
host tier is an LRU that hands its victims down; the disk tier writes atomically, keeps its budget by LRU, ignores
what killed writers leave and files that vanish, also with several processes writing one directory."""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import time

import pytest
import torch

from common.kv.block_hash import ROOT_HASH, hash_block
from common.kv.tiers.disk import DiskFull, DiskTier
from common.kv.tiers.host import HostTier
from common.kv.tiers.identity import TierLayout, weights_identity
from common.kv.tiers.metrics import TierMetrics
from common.kv.tiers.record import BlockKey, RecordRejected, StoredBlock, checksum, decode, encode_header
from common.telemetry.metrics import Metrics

LAYOUT = TierLayout(fingerprint="f" * 16, weights="w", block_size=4, dtype="float32", num_layers=2,
                    num_kv_heads=2, head_dim=8)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4


def _block(i: int, parent: int = ROOT_HASH) -> StoredBlock:
    tokens = (i, i + 1, i + 2, i + 3)
    payload = torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
    return StoredBlock(BlockKey(hash_block(parent, list(tokens)), parent, tokens), payload, checksum(payload))


def _record(block: StoredBlock, layout: TierLayout = LAYOUT) -> bytearray:
    return bytearray(encode_header(layout, block) + block.payload.numpy().tobytes())


def test_a_record_round_trips_and_verifies():
    block = _block(1)
    back = decode(_record(block), LAYOUT)
    back.verify(block.key, BLOCK_BYTES)
    assert back.key == block.key and torch.equal(back.payload, block.payload) and back.tier == "disk"


@pytest.mark.parametrize("damage, reason", [
    (lambda r: r[:-1], "truncated"),
    (lambda r: r[:10], "truncated"),
    (lambda r: b"XXXX" + r[4:], "format"),
    (lambda r: r[:30] + bytes([r[30] ^ 1]) + r[31:], "checksum"),  # inside the header
])
def test_a_damaged_record_is_rejected_by_decode(damage, reason):
    with pytest.raises(RecordRejected) as raised:
        decode(bytearray(damage(bytes(_record(_block(2))))), LAYOUT)
    assert raised.value.reason == reason


def test_a_flipped_payload_byte_fails_the_checksum():
    record = _record(_block(3))
    record[-1] ^= 0xFF
    with pytest.raises(RecordRejected) as raised:
        decode(record, LAYOUT).verify(_block(3).key, BLOCK_BYTES)
    assert raised.value.reason == "checksum"


@pytest.mark.parametrize("field, value", [("fingerprint", "another-model"), ("weights", "a-fine-tune"),
                                          ("dtype", "bfloat16"), ("block_size", 16), ("num_kv_heads", 4),
                                          ("shard", "rank-1-of-2")])
def test_a_record_of_another_layout_is_rejected_naming_the_difference(field, value):
    other = dataclasses.replace(LAYOUT, **{field: value})
    with pytest.raises(RecordRejected) as raised:
        decode(_record(_block(4), other), LAYOUT)
    assert raised.value.reason == "layout" and field in str(raised.value)
    assert other.id != LAYOUT.id


def test_a_block_under_another_key_or_chain_is_rejected():
    block, other = _block(5), _block(6)
    with pytest.raises(RecordRejected, match="key"):
        block.verify(other.key, BLOCK_BYTES)
    forged = dataclasses.replace(block, key=dataclasses.replace(block.key, parent=12345))  # hash no longer its own
    with pytest.raises(RecordRejected, match="key"):
        forged.verify(forged.key, BLOCK_BYTES)


def test_weights_identity_tells_two_checkpoints_of_one_shape_apart(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for directory, fill in ((a, 1), (b, 2)):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(bytes([fill]) * 4096)
    assert weights_identity(str(a)) != weights_identity(str(b))
    assert weights_identity(str(a)) == weights_identity(str(a))
    assert weights_identity(str(a), "dummy", 1) != weights_identity(str(a), "dummy", 2)


def test_the_host_tier_is_an_lru_whose_victims_go_down_with_their_bytes():
    host = HostTier(3 * BLOCK_BYTES, BLOCK_BYTES, pin=False)
    blocks = [_block(i) for i in range(4)]
    for block in blocks[:3]:
        assert host.put(block) == []
    assert host.get(blocks[0].key.hash) is not None  # now the most recent
    [victim] = host.put(blocks[3])
    assert victim.key == blocks[1].key and torch.equal(victim.payload, blocks[1].payload)
    assert blocks[1].key.hash not in host and host.used_bytes == 3 * BLOCK_BYTES
    got = host.get(blocks[3].key.hash)
    got.verify(blocks[3].key, BLOCK_BYTES)
    assert got.tier == "host"


def test_a_reserved_host_slot_is_seen_only_once_committed_and_its_lru_victims_go_down():
    host = HostTier(3 * BLOCK_BYTES, BLOCK_BYTES, pin=False)
    blocks = [_block(i) for i in range(4)]
    slots, dropped = host.reserve(2, drop_lru=False)
    assert len(slots) == 2 and not dropped
    for slot, block in zip(slots, blocks):
        host.slab[slot].copy_(block.payload)
        assert block.key.hash not in host and host.get(block.key.hash) is None  # not before its commit
    assert all(host.commit(slot, b.key, checksum(host.slab[slot])) for slot, b in zip(slots, blocks))
    host.get(blocks[0].key.hash).verify(blocks[0].key, BLOCK_BYTES)
    [again], _ = host.reserve(1, drop_lru=False)
    assert not host.commit(again, blocks[1].key, blocks[1].checksum)  # held already: the slot goes back
    assert host.put(blocks[2]) == [] and host.reserve(1, drop_lru=False) == ([], [])  # full: none free
    [victim] = host.evict_to(1)  # blocks[0]: its read came before blocks[1]'s second commit
    assert victim.key == blocks[0].key and torch.equal(victim.payload, blocks[0].payload)
    host.release(host.reserve(1, drop_lru=False)[0])
    slots, dropped = host.reserve(3, drop_lru=True)  # no tier below: the LRU makes room itself
    assert len(slots) == 3 and set(dropped) == {blocks[1].key.hash, blocks[2].key.hash} and host.used_bytes == 0


def test_a_load_runs_while_a_store_is_still_writing():
    """Loads have a thread of their own: a prefetch never waits behind a slow store (a disk write of host victims)."""
    import threading

    from common.kv.tiers.mover import Mover

    mover, writing, release = Mover(), threading.Event(), threading.Event()
    try:
        assert mover.store(lambda: (writing.set(), release.wait(30)), nbytes=1)
        assert writing.wait(5)
        assert mover.load(lambda: "loaded").result(timeout=5) == "loaded"
        assert mover.pending_bytes == 1  # the store still runs
    finally:
        release.set()
        mover.close()
    assert mover.pending_bytes == 0


def _disk(path, blocks: int, metrics: TierMetrics | None = None) -> DiskTier:
    size = len(_record(_block(0)))
    return DiskTier(path, blocks * size, LAYOUT, metrics or TierMetrics())


def test_the_disk_tier_round_trips_and_leaves_no_temporary_file(tmp_path):
    disk = _disk(tmp_path, 8)
    block = _block(7)
    assert disk.write(block) > 0 and disk.write(block) == 0  # the second: already there, only touched
    assert block.key.hash in disk and disk.path(block.key.hash).parent.parent == tmp_path / LAYOUT.id
    decode(disk.read(block.key.hash), LAYOUT).verify(block.key, BLOCK_BYTES)
    assert not [p for p in tmp_path.rglob("*.tmp")]
    assert (tmp_path / LAYOUT.id / "layout.json").exists()


def test_the_disk_tier_keeps_its_budget_evicting_the_least_recently_read(tmp_path):
    metrics = TierMetrics()
    disk = _disk(tmp_path, 4, metrics)
    blocks = [_block(i) for i in range(8)]
    for i, block in enumerate(blocks[:4]):
        disk.write(block)
        os.utime(disk.path(block.key.hash), (1000 + i, 1000 + i))
    disk.read(blocks[0].key.hash)  # read: the most recent now
    disk.write(blocks[4])  # full: down to LOW_WATER of the budget, the least recently read first
    assert {i for i, b in enumerate(blocks) if b.key.hash in disk} == {0, 3, 4}
    assert metrics.total("disagg_kv_tier_evictions_total", tier="disk") == 2
    for block in blocks[5:]:
        disk.write(block)
        assert sum(p.stat().st_size for p in tmp_path.rglob("*.kv")) <= disk.capacity


def test_a_block_larger_than_the_budget_is_refused_not_written(tmp_path):
    disk = DiskTier(tmp_path, 100, LAYOUT, TierMetrics())
    with pytest.raises(DiskFull):
        disk.write(_block(8))
    assert not list(tmp_path.rglob("*.kv"))


def test_a_killed_writers_temporary_is_never_read_and_is_swept_once_stale(tmp_path):
    disk = _disk(tmp_path, 8)
    block = _block(9)
    final = disk.path(block.key.hash)
    final.parent.mkdir(parents=True)
    temp = final.parent / f".{final.name}.99999.1.tmp"
    temp.write_bytes(bytes(_record(block))[:50])  # what a writer killed mid-write leaves
    assert block.key.hash not in disk and disk.read(block.key.hash) is None
    os.utime(temp, (time.time() - 2 * DiskTier.TEMP_AGE_S,) * 2)
    _disk(tmp_path, 8)  # a new worker's first scan
    assert not temp.exists()


def test_a_file_evicted_by_another_process_is_a_miss(tmp_path):
    disk = _disk(tmp_path, 8)
    block = _block(10)
    disk.write(block)
    os.unlink(disk.path(block.key.hash))  # another process's eviction
    assert disk.read(block.key.hash) is None
    disk.discard(block.key.hash)
    assert disk.write(block) > 0


def _write_forever(path: str, first: int) -> None:
    disk = _disk(path, 64)
    i = first
    while True:
        disk.write(_block(i % 200))
        i += 1


def test_processes_writing_one_directory_killed_mid_write_leave_only_whole_records(tmp_path):
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_forever, args=(str(tmp_path), n * 7)) for n in range(2)]
    for writer in writers:
        writer.start()
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.rglob("*.kv"))) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for writer in writers:
            os.kill(writer.pid, signal.SIGKILL)
            writer.join()
    records = list(tmp_path.rglob("*.kv"))
    assert len(records) >= 40
    blocks = {b.key.hash: b for b in map(_block, range(200))}
    for path in records:
        stored = decode(bytearray(path.read_bytes()), LAYOUT)
        stored.verify(blocks[stored.key.hash].key, BLOCK_BYTES)
    assert sum(p.stat().st_size for p in records) <= _disk(tmp_path, 64).capacity * 1.25


def test_tier_counts_reach_the_workers_prometheus_metrics():
    from prometheus_client import generate_latest

    metrics, tiers = Metrics.create("decode", "m"), TierMetrics()
    tiers.bind(metrics)
    tiers.hit("disk", 2, 8, 2 * BLOCK_BYTES, 0.01)
    tiers.rejected("disk", "checksum")
    text = generate_latest(metrics.registry).decode()
    assert 'disagg_kv_tier_hit_tokens_total{model="m",role="decode",tier="disk"} 8.0' in text
    assert 'disagg_kv_tier_recomputes_total{model="m",reason="checksum",role="decode",tier="disk"} 1.0' in text
    assert tiers.total("disagg_kv_tier_hit_blocks_total", tier="disk") == 2

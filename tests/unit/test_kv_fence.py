"""The fenced import straight into the importer's blocks (cuda_ipc's direct.py, common.kv.fence): it gives the
aggregated tokens, a read of blocks the exporter reused (before or while the copy ran) is detected and
never served, and no block is lost either way. On the CPU through the torch copy; on a GPU (when there is
one) through the Triton kernel and the side stream, the path `cuda_ipc` takes."""
from __future__ import annotations

import asyncio
import os
import random
from typing import Callable

import pytest
import torch

from common.engine.block_manager import BlockManager
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import Request, RequestType, SamplingParams
from common.errors import InvalidRequest
from common.kv import fence
from common.kv.fence import EPOCH_ATTRIBUTE, BlockEpochs, StaleKv
from common.kv.layout import layout_of
from common.kv.transports import one_sided
from common.kv.transports.cuda_ipc import direct
from common.kv.transports.cuda_ipc.block_copy import BlockCopier, compile_for, copy_blocks, copy_blocks_reference
from common.kv.wire import session_ref

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(10, 27))  # 17 tokens: 5 blocks of 4
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def _context(engine: LLMEngine, request_id: str, prompt: list[int]) -> str:
    engine.add_request(request_id, prompt, GREEDY, RequestType.CONTEXT_ONLY)
    _run(engine)
    return next(s for s in engine.sessions.sessions.values() if s.request_id == request_id).session_id


@pytest.fixture(params=DEVICES)
def pair(request, tiny_llama):
    config = EngineConfig(model=tiny_llama, device=request.param, block_size=4, num_kv_blocks=24)
    exporter, importer = LLMEngine(config), LLMEngine(config)
    epochs = BlockEpochs.create(exporter.block_manager.num_blocks)
    exporter.kv_blocks().count_reuse(epochs)
    yield exporter, importer, epochs
    exporter.kv_blocks().count_reuse(None)
    epochs.close()


def _import(exporter: LLMEngine, importer: LLMEngine, epochs: BlockEpochs, session_id: str,
            copied: Callable[[], None] = lambda: None):
    ref = session_ref(exporter.kv_layout, exporter.sessions.get(session_id), "127.0.0.1:1")
    reader = BlockEpochs.open(str(epochs.path), epochs.num_blocks)  # as the importer maps it
    try:
        copier = BlockCopier(exporter.kv_cache, importer.kv_cache)
        return asyncio.run(direct.import_placed(copier, reader, ref, layout_of(ref), importer.kv_blocks(), copied))
    finally:
        reader.close()


def test_a_fenced_import_into_our_blocks_gives_the_aggregated_tokens(pair):
    exporter, importer, epochs = pair
    session_id = _context(exporter, "p", PROMPT)
    first = exporter.sessions.get(session_id).first_token
    placed = _import(exporter, importer, epochs, session_id)
    assert len(placed.block_ids) == 5 and importer.block_manager.num_free_blocks == 24 - 5
    importer.add_request("d", PROMPT, GREEDY, RequestType.GENERATION_ONLY, placed, first)
    assert placed.adopt() is None  # the engine owns the blocks now
    decoded = [first] + _run(importer)["d"]
    importer.add_request("a", PROMPT, GREEDY)
    assert decoded == _run(importer)["a"]
    assert importer.block_manager.num_free_blocks == 24


def test_an_import_waits_for_room_beside_the_running_growth_then_lands(pair):
    """A pull into a pool whose free blocks the running requests will grow into waits (the session stays with its
    exporter) and is reserved as soon as they need them no more; the copy then gives the aggregated tokens. With
    no room within its wait, it gives up (the caller pulls beside the pool), holding no block."""
    exporter, importer, epochs = pair
    session_id = _context(exporter, "p", PROMPT)
    first = exporter.sessions.get(session_id).first_token
    ref = session_ref(exporter.kv_layout, exporter.sessions.get(session_id), "127.0.0.1:1")
    pool = importer.block_manager
    pool.growth_reserved = pool.num_free_blocks - 2  # the running rows' growth: 2 spare, the import needs 5

    async def wait_then_import():
        assert await direct.reserve_with_room(importer.kv_blocks(), ref, 0.02) is None
        room = asyncio.get_running_loop().call_later(0.03, setattr, pool, "growth_reserved", 0)  # rows finished
        started = asyncio.get_running_loop().time()
        reserved = await direct.reserve_with_room(importer.kv_blocks(), ref, 5.0)
        waited = asyncio.get_running_loop().time() - started
        room.cancel()
        reader = BlockEpochs.open(str(epochs.path), epochs.num_blocks)
        try:
            placed = await direct.import_placed(BlockCopier(exporter.kv_cache, importer.kv_cache), reader, ref,
                                                layout_of(ref), importer.kv_blocks(), lambda: None, None, reserved)
        finally:
            reader.close()
        return placed, waited

    assert pool.num_free_blocks == 24
    placed, waited = asyncio.run(wait_then_import())
    assert 0.02 <= waited < 1.0 and len(placed.block_ids) == 5 and pool.num_free_blocks == 24 - 5
    importer.add_request("d", PROMPT, GREEDY, RequestType.GENERATION_ONLY, placed, first)
    decoded = [first] + _run(importer)["d"]
    importer.add_request("a", PROMPT, GREEDY)
    assert decoded == _run(importer)["a"]
    assert pool.num_free_blocks == 24


def test_a_read_of_blocks_reused_before_the_copy_is_never_served(pair):
    exporter, importer, epochs = pair
    session_id = _context(exporter, "p", PROMPT)
    ref_blocks = list(exporter.sessions.get(session_id).block_ids)
    stale_ref = session_ref(exporter.kv_layout, exporter.sessions.get(session_id), "127.0.0.1:1")
    exporter.release_session(session_id)
    exporter.add_request("other", [5] * 90, GREEDY)  # 96 tokens: every block of the pool is written again
    _run(exporter)
    assert epochs.total(ref_blocks) > int(stale_ref.attributes[EPOCH_ATTRIBUTE])  # the session's blocks were reused
    reader = BlockEpochs.open(str(epochs.path), epochs.num_blocks)
    with pytest.raises(StaleKv, match="reused"):
        asyncio.run(direct.import_placed(BlockCopier(exporter.kv_cache, importer.kv_cache), reader, stale_ref,
                                         layout_of(stale_ref), importer.kv_blocks(), lambda: None))
    reader.close()
    assert importer.block_manager.num_free_blocks == 24  # the reserved blocks went back


def test_a_reuse_racing_the_copy_is_detected_after_it(pair):
    """The Release goes out once the copy has finished; the exporter may free and reuse the blocks before the check
    (or, on a GPU, while a copy it raced still ran). Here that happens inside `copied`, between copy and check."""
    exporter, importer, epochs = pair
    session_id = _context(exporter, "p", PROMPT)

    def release_and_reuse() -> None:
        exporter.release_session(session_id)
        exporter.add_request("other", [5] * 90, GREEDY)
        _run(exporter)
    with pytest.raises(StaleKv):
        _import(exporter, importer, epochs, session_id, release_and_reuse)
    assert importer.block_manager.num_free_blocks == 24


def test_freed_blocks_reused_through_the_prefix_cache_keep_their_epochs(pair):
    exporter, importer, epochs = pair
    session_id = _context(exporter, "p", PROMPT)
    old_blocks = exporter.sessions.get(session_id).block_ids
    before = [epochs.total([b]) for b in old_blocks[:4]]
    exporter.release_session(session_id)  # back in the pool, its four full blocks still cached
    again = _context(exporter, "q", PROMPT)  # a prefix-cache hit: the same four blocks, nothing written in them
    assert exporter.sessions.get(again).block_ids[:4] == old_blocks[:4]
    assert [epochs.total([b]) for b in old_blocks[:4]] == before
    placed = _import(exporter, importer, epochs, again)
    assert len(placed.block_ids) == 5
    placed.discard()
    placed.discard()  # once
    assert importer.block_manager.num_free_blocks == 24


class _Releases:
    """What read_one_sided asks of an importer's Releases: those it sends without waiting for them, and a failed
    read's."""

    def __init__(self):
        self.released_later: list[str] = []
        self.released_now: list[str] = []

    def later(self, ref) -> None:
        self.released_later.append(ref.session_id)

    async def now(self, ref) -> None:
        self.released_now.append(ref.session_id)


class _Puller:
    def __init__(self):
        self.releases = _Releases()


def _read_one_sided(exporter: LLMEngine, epochs: BlockEpochs, ref, during_read: Callable[[], None] = lambda: None,
                    puller: _Puller | None = None):
    """A one-sided read (nixl's, or cuda_ipc's gather into a new tensor) of the exporter's cache, fenced by its
    epochs; its channel answers nothing, so awaiting a Release fails the test."""
    puller, reader = puller or _Puller(), BlockEpochs.open(str(epochs.path), epochs.num_blocks)

    async def read(_channel, ref) -> torch.Tensor:
        blocks = exporter.kv_cache[:, :, list(ref.block_ids)].clone()
        during_read()
        return blocks
    try:
        pulled = asyncio.run(one_sided.read_one_sided(puller, None, ref, "nixl", read, 5.0, reader))
    finally:
        reader.close()
    return pulled, puller.releases.released_later


def test_a_fenced_one_sided_read_is_served_without_waiting_for_its_release(pair):
    exporter, _, epochs = pair
    session_id = _context(exporter, "p", PROMPT)
    ref = session_ref(exporter.kv_layout, exporter.sessions.get(session_id), "127.0.0.1:1")
    pulled, released_later = _read_one_sided(exporter, epochs, ref)
    assert torch.equal(pulled.export.blocks.cpu(), exporter.export_session(session_id).blocks)  # (it exports to the CPU)
    assert released_later == [session_id]  # sent, never awaited


def test_a_fenced_one_sided_read_of_blocks_reused_during_it_is_never_served(pair):
    exporter, _, epochs = pair
    session_id = _context(exporter, "p", PROMPT)
    ref = session_ref(exporter.kv_layout, exporter.sessions.get(session_id), "127.0.0.1:1")
    puller = _Puller()

    def release_and_reuse() -> None:
        exporter.release_session(session_id)
        exporter.add_request("other", [5] * 90, GREEDY)
        _run(exporter)
    with pytest.raises(StaleKv, match="reused"):
        _read_one_sided(exporter, epochs, ref, release_and_reuse, puller)
    assert puller.releases.released_now == [session_id]  # released all the same: the exporter's TTL need not free it


def test_block_epochs_count_allocations_for_new_content():
    epochs = BlockEpochs.create(4)
    try:
        manager = BlockManager(4, block_size=2)
        manager.count_reuse(epochs)
        request = Request("r", [1, 2, 3])
        assert manager.allocate_slots(request, 3) and request.block_table == [0, 1]
        assert [epochs.total([b]) for b in range(4)] == [1, 1, 0, 0]
        manager.free(request)
        assert manager.reserve(4) == [0, 1, 2, 3]  # one run: the LRU head (2) and its free neighbours
        assert [epochs.total([b]) for b in range(4)] == [2, 2, 1, 1]
    finally:
        epochs.close()
    assert not epochs.path.exists()


def test_reserve_skips_blocks_a_step_in_flight_may_still_write():
    manager = BlockManager(3, block_size=2)
    request = Request("r", [1, 2])
    manager.allocate_slots(request, 2)
    manager.steps_launched, manager.steps_done = 5, 4  # step 5 (launched ahead) may still write request's block
    manager.free(request)
    assert manager.reserve(3) is None
    assert manager.reserve(2) == [1, 2]
    manager.steps_done = 5
    assert manager.reserve(1) == [0]


def test_an_epoch_table_left_by_a_dead_process_is_swept():
    dead = fence.SHM_DIR / f"{fence.PREFIX}{_dead_pid()}-0123456789ab"
    dead.write_bytes(bytes(8))
    mine = BlockEpochs.create(2)  # creating a table sweeps first
    try:
        assert not dead.exists() and mine.path.exists()
        with pytest.raises(InvalidRequest, match="must name a file"):
            BlockEpochs.open("/tmp/elsewhere", 2)
    finally:
        mine.close()


def _dead_pid() -> int:
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_moves_every_layer_of_each_block_to_its_destination(device):
    src = torch.randn(3, 2, 9, 4, 2, 8, device=device).to(torch.bfloat16)
    dst = torch.full((3, 2, 7, 4, 2, 8), float("nan"), device=device, dtype=torch.bfloat16)
    expected = dst.clone()
    src_ids, dst_ids = [8, 0, 3, 4], [2, 6, 0, 1]
    copy_blocks(src, src_ids, dst, dst_ids)
    copy_blocks_reference(src, src_ids, expected, dst_ids)
    assert torch.equal(dst.cpu().view(torch.int16), expected.cpu().view(torch.int16))
    assert torch.equal(dst[:, :, 2].cpu(), src[:, :, 8].cpu()) and dst[:, :, 3].isnan().all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy kernel runs on a GPU (elsewhere the copier is "
                    "the reference copy itself)")
def test_one_copier_moves_any_number_of_blocks_through_the_kernel_it_compiled_once():
    """The copier's kernel is compiled by its first copy and launched directly after that, for every block count
    (1 and 16 included, which Triton would otherwise specialise on)."""
    src = torch.randn(3, 2, 40, 4, 2, 8, device="cuda").to(torch.bfloat16)
    dst = torch.zeros(3, 2, 40, 4, 2, 8, device="cuda", dtype=torch.bfloat16)
    expected = dst.clone()
    copier = BlockCopier(src, dst)
    rng = random.Random(7)
    for n in (5, 1, 16, 3, 32, 1):
        src_ids, dst_ids = rng.sample(range(40), n), rng.sample(range(40), n)
        reading = copier(src_ids, dst_ids, torch.cuda.current_stream())
        assert reading.is_pinned()
        copy_blocks_reference(src, src_ids, expected, dst_ids)
        assert torch.equal(dst.cpu().view(torch.int16), expected.cpu().view(torch.int16)), n
        del reading  # (kept until the copy had finished: .cpu() waited for it)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy kernel runs on a GPU")
def test_the_kernel_compiled_at_startup_serves_copies_between_caches_of_any_block_count():
    """compile_for (a decode worker's start) leaves nothing for a pull's first copy to compile: caches of the same
    block shape share one compiled kernel, whatever their block counts."""
    from common.kv.transports.cuda_ipc import block_copy_triton

    cache = torch.zeros(3, 2, 37, 4, 2, 8, device="cuda", dtype=torch.bfloat16)
    compile_for(cache)
    compiled = block_copy_triton._copy_blocks_kernel.device_caches[cache.device.index][0]
    before = len(compiled)
    exporter = torch.randn(3, 2, 80, 4, 2, 8, device="cuda").to(torch.bfloat16)
    copier = BlockCopier(exporter, cache)
    reading = copier([79, 3, 16], [36, 0, 5])
    torch.cuda.synchronize()
    del reading
    assert len(compiled) == before
    moved = cache[:, :, [36, 0, 5]].cpu().view(torch.int16)
    assert torch.equal(moved, exporter[:, :, [79, 3, 16]].cpu().view(torch.int16))

"""An export's lease and a session's release never wait for the exporter's engine thread: a pull is served, and a
release frees the blocks (once the export ends), while the engine is stuck in a long step; and leases, exports and
releases racing the engine's own steps lose no block."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from functools import partial
from typing import Callable

import pytest
import torch

from common.engine.async_engine import AsyncLLMEngine
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import RequestType, SamplingParams
from common.errors import NotFound
from common.kv import gather, host
from common.kv.sharing import KvCacheExporter
from common.kv.transports.grpc_pull import pull_chunks
from common.kv.transports.shm import pull_shm
from common.kv.wire import release_session, session_ref
from tests.loopback_grpc import loopback_server

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
NUM_BLOCKS = 64
PROMPT = list(range(10, 27))  # 17 tokens: 5 blocks of 4
WITHIN_S = 5.0  # far less than the blocked step; far more than a lease takes


class BlockedStep:
    """Makes the engine's next step wait until `release()`, as a long prefill or decode step would."""

    def __init__(self, llm: LLMEngine):
        self.entered, self._gate, self._step = threading.Event(), threading.Event(), llm.step
        llm.step = self._blocked

    def _blocked(self):
        self.entered.set()
        self._gate.wait(60)
        return self._step()

    def release(self) -> None:
        self._gate.set()


@pytest.fixture
def engine(tiny_llama):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=NUM_BLOCKS)))
    yield engine
    engine.shutdown()


async def _until(done, within_s: float = WITHIN_S) -> None:
    """Wait (on the event loop, polling) until `done()`: the engine thread works meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not done():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def _start(engine: AsyncLLMEngine, request_id: str, prompt: list[int],
                 request_type: RequestType = RequestType.CONTEXT_AND_GENERATION) -> None:
    """Hand the engine thread a request (its outputs go nowhere); the loop steps it."""
    await engine.call(lambda e: e.add_request(request_id, prompt, GREEDY, request_type))


async def _session(engine: AsyncLLMEngine, request_id: str, prompt: list[int]) -> str:
    """A session made by the engine thread's own steps."""
    await _start(engine, request_id, prompt, RequestType.CONTEXT_ONLY)
    ids: list[str] = []
    await _until(lambda: ids.extend(engine.engine.sessions.ids_of(request_id)) or ids)
    return ids[0]


async def _export(engine: AsyncLLMEngine, cache: torch.Tensor, session_id: str) -> torch.Tensor:
    """What TensorStore.Pull does with the engine (common.kv.paths.DataPlane.export) and the cache
    it asked for once at start: lease the session's blocks, gather them off the engine thread, end the lease."""
    ids = await engine.lease_session(session_id)
    try:
        return await gather.gather_to_host(cache, ids)
    finally:
        await engine.end_lease(session_id)


async def _stuck_in_a_step(engine: AsyncLLMEngine) -> tuple[BlockedStep, Callable[[], bool]]:
    """The engine thread inside a step that does not end until the BlockedStep is released; and whether the
    request that step runs has finished."""
    blocked = BlockedStep(engine.engine)
    await _start(engine, "busy", list(range(40, 50)))
    assert await asyncio.to_thread(blocked.entered.wait, WITHIN_S)
    return blocked, lambda: "busy" not in engine.engine.requests


def test_a_pull_and_its_release_are_served_while_the_engine_thread_is_stuck_in_a_step(engine):
    async def scenario() -> tuple[int, int, int]:
        session_id = await _session(engine, "p", PROMPT)
        expected = engine.engine.export_session(session_id).blocks
        cache = await engine.kv_cache()
        blocked, busy_done = await _stuck_in_a_step(engine)
        try:
            assert torch.equal(await asyncio.wait_for(_export(engine, cache, session_id), WITHIN_S), expected)
            assert await asyncio.wait_for(engine.release_session(session_id), WITHIN_S)
            free_while_stuck = engine.engine.block_manager.num_free_blocks
            assert not busy_done()  # all of it happened while the step had not ended
        finally:
            blocked.release()
        await _until(busy_done)
        return free_while_stuck, engine.engine.block_manager.num_free_blocks, engine.engine.num_leased_released

    free_while_stuck, free_after, leased_released = asyncio.run(scenario())
    assert free_after == NUM_BLOCKS and leased_released == 0
    assert free_while_stuck == NUM_BLOCKS  # the session's blocks were back before the step ended


def test_a_release_during_an_export_frees_the_blocks_when_the_lease_ends_with_the_engine_stuck(engine):
    async def scenario() -> list[int]:
        session_id = await _session(engine, "p", PROMPT)
        blocked, busy_done = await _stuck_in_a_step(engine)
        pool = engine.engine.block_manager
        try:
            ids = await asyncio.wait_for(engine.lease_session(session_id), WITHIN_S)
            before = pool.num_free_blocks
            assert await asyncio.wait_for(engine.release_session(session_id), WITHIN_S)
            during = pool.num_free_blocks  # released, but the export still reads: pinned
            await asyncio.wait_for(engine.end_lease(session_id), WITHIN_S)
            after = pool.num_free_blocks
            assert not await engine.release_session(session_id)  # released once only
        finally:
            blocked.release()
        await _until(busy_done)
        return [len(ids), during - before, after - before, pool.num_free_blocks]

    assert asyncio.run(scenario()) == [5, 0, 5, NUM_BLOCKS]


def test_leases_exports_and_releases_racing_the_engine_steps_lose_no_block(engine):
    """Sessions made by the engine thread while the event loop exports and releases the earlier ones, and other
    requests allocate and free blocks in every step: every block is back, no lease is left."""
    async def scenario() -> list[int]:
        cache = await engine.kv_cache()

        async def handoff(i: int) -> None:
            session_id = await _session(engine, f"p{i}", list(range(i, i + 9 + i % 7)))
            exports = [_export(engine, cache, session_id) for _ in range(2)]
            results = await asyncio.gather(*exports, engine.release_session(session_id), return_exceptions=True)
            assert results[-1] is True  # an export that came after the release is refused: NotFound
            assert all(isinstance(r, (torch.Tensor, NotFound)) for r in results[:-1]), results

        for i in range(6):
            await _start(engine, f"g{i}", list(range(50 + i, 62 + i)))
        await asyncio.wait_for(asyncio.gather(*(handoff(i) for i in range(12))), 60)
        await _until(lambda: not engine.engine.requests)
        pool, sessions = engine.engine.block_manager, engine.engine.sessions
        return [pool.num_free_blocks, len(sessions.sessions), engine.engine.num_leased_released]

    assert asyncio.run(scenario()) == [NUM_BLOCKS, 0, 0]


@dataclass
class _Holder:  # services.worker.tensor_store.TensorHolder
    tensor_source: object
    max_message_bytes: int = 64 << 20
    metrics: None = None


def test_tensor_store_serves_grpc_and_shm_pulls_and_releases_while_the_engine_thread_is_stuck(engine):
    """The same through the real TensorStore servicer on a loopback port, pulled by the importers' own clients."""
    from common.kv.paths import DataPlane
    from services.worker.tensor_store import TensorStoreServicer, add_tensor_store

    async def scenario() -> dict[str, bool]:
        session_id = await _session(engine, "p", PROMPT)
        facts, cache = await engine.facts(), await engine.kv_cache()
        transports = ("shm", "grpc") if host.host_id() else ("grpc",)
        source = DataPlane("torch", transports, KvCacheExporter(cache, transports), engine=engine, layout=facts.kv_layout)
        async with loopback_server(partial(add_tensor_store, TensorStoreServicer(_Holder(source)))) as (_, address):
            ref = session_ref(facts.kv_layout, engine.engine.sessions.get(session_id), address)
            expected = engine.engine.export_session(session_id).blocks
            blocked, busy_done = await _stuck_in_a_step(engine)
            try:
                pulls = {"grpc": pull_chunks, **({"shm": pull_shm} if host.host_id() else {})}
                seen = {name: torch.equal((await pull(ref.endpoint, ref, timeout_s=WITHIN_S)).export.blocks, expected)
                        for name, pull in pulls.items()}
                seen["released"] = (await release_session(ref.endpoint, session_id, timeout_s=WITHIN_S)).released
                seen["while stuck"] = not busy_done()
            finally:
                blocked.release()
        await _until(busy_done)
        return {**seen, "freed": engine.engine.block_manager.num_free_blocks == NUM_BLOCKS}

    seen = asyncio.run(scenario())
    assert all(seen.values()), seen

"""GetLoad's prompt_tokens_to_compute: the prompt tokens an engine's steps still have to compute, whatever queue they
wait in; a handoff that brought its KV has none (a decode worker's waiting requests are mostly those, which is why
the router's room rule reads this count, not waiting_requests)."""
import asyncio
import threading

import grpc

from common.discovery import Role
from common.engine.async_engine import AsyncLLMEngine
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.interface import EngineLoad, EngineRequest
from common.engine.request import RequestType, SamplingParams
from common.pb.disagg.v1 import worker_pb2
from services.router.disagg_decision import _decode_load
from services.router.workers import WorkerClient
from services.worker.service import _load_proto

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _engine(path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, **{"block_size": 4, "num_kv_blocks": 64, **overrides}))


def test_queued_and_part_way_prompts_count_until_computed(tiny_llama):
    engine = _engine(tiny_llama, max_num_batched_tokens=8)  # chunks of 8: a prompt part-way across steps
    engine.add_request("a", list(range(10, 30)), GREEDY)
    engine.add_request("b", list(range(40, 52)), GREEDY)
    counts = [engine.load_snapshot().prompt_tokens_to_compute]
    for _ in range(20):
        if counts[-1] == 0:
            break
        engine.step()
        counts.append(engine.load_snapshot().prompt_tokens_to_compute)
    assert counts[0] == 32 and counts[-1] == 0
    assert all(0 <= a - b <= 8 for a, b in zip(counts, counts[1:]))  # down by at most a step's budget
    # zero exactly when both prompts are computed: two decode rows, nothing waiting
    assert engine.num_running == 2 and engine.num_waiting == 0
    assert all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)
    engine.step()
    assert engine.load_snapshot().prompt_tokens_to_compute == 0


def test_a_handoff_with_its_kv_has_nothing_to_compute_but_one_without_recomputes(tiny_llama):
    prompt = list(range(10, 29))
    prefill, decode = _engine(tiny_llama), _engine(tiny_llama)
    prefill.add_request("p", prompt, GREEDY, RequestType.CONTEXT_ONLY)
    (context,) = prefill.step()
    kv = prefill.export_session(context.session_id)
    decode.add_request("with-kv", prompt, GREEDY, RequestType.GENERATION_ONLY, kv_import=kv,
                       first_token=context.new_token_ids[0])
    load = decode.load_snapshot()
    assert load.waiting == 1 and load.prompt_tokens_to_compute == 0
    decode.add_request("without-kv", prompt, GREEDY, RequestType.GENERATION_ONLY,
                       first_token=context.new_token_ids[0])  # its KV lost: the engine recomputes the prompt
    assert decode.load_snapshot().prompt_tokens_to_compute == len(prompt)


def test_a_prompt_on_its_way_to_the_engine_thread_counts_already(tiny_llama):
    async def main() -> tuple[int, int, int, int]:
        engine = AsyncLLMEngine(_engine(tiny_llama))
        hold = threading.Event()
        try:
            held = asyncio.ensure_future(engine.call(lambda e: hold.wait(10)))  # the engine thread busy elsewhere
            stream = engine.generate(EngineRequest("a", list(range(10, 22)), GREEDY))
            first = asyncio.ensure_future(anext(stream))  # its add command queues behind the busy one
            for _ in range(500):
                if (await engine.load()).waiting:
                    break
                await asyncio.sleep(0.01)
            load = await engine.load()
            in_engine = engine.engine.load_snapshot().prompt_tokens_to_compute  # the add has not run there yet
            hold.set()
            await held
            outputs = [await first] + [out async for out in stream]
            assert outputs[-1].finished
            after = await engine.load()
            return load.waiting, load.prompt_tokens_to_compute, in_engine, after.prompt_tokens_to_compute
        finally:
            hold.set()
            engine.shutdown()

    assert asyncio.run(main()) == (1, 12, 0, 0)


def test_the_router_reads_the_count_from_getload_and_falls_back_without_it():
    def room(prompt_tokens_to_compute: int | None, waiting: int) -> bool:
        load = _load_proto(EngineLoad(running=1, waiting=waiting, kv_blocks_total=64, kv_blocks_free=60,
                                      kv_usage_ratio=0.06, active_sessions=0, expired_sessions=0, session_bytes=0,
                                      prompt_tokens_to_compute=prompt_tokens_to_compute))
        assert load.HasField("prompt_tokens_to_compute") == (prompt_tokens_to_compute is not None)
        info = worker_pb2.WorkerInfo(limits=worker_pb2.WorkerLimits(max_num_seqs=8))
        worker = WorkerClient(Role.DECODE, "d:1", channel=grpc.aio.insecure_channel("d:1"), info=info, healthy=True)
        return _decode_load(worker, load).has_room

    async def main() -> list[bool]:  # (an aio channel wants a loop)
        return [room(0, waiting=3), room(50, waiting=0), room(None, waiting=3), room(None, waiting=0)]

    # three handoffs waiting to join and nothing to prefill: room; another router's local prefill under way: none;
    # a worker that does not report the count: its waiting requests decide, as before
    assert asyncio.run(main()) == [True, False, False, True]

"""Chaos: hundreds of requests through router → prefill → decode processes, ~32 at a time, over Generate and
GenerateStream, with cancels and client disconnects injected at random stages.

Every request that was not cancelled returns HF's greedy tokens; a cancelled one delivered a prefix of them.
Afterwards every worker is back to its start (all KV blocks free, no session, no stored tensor, nothing
running or waiting) and the router still serves. DISAGG_CHAOS_REQUESTS=1000 runs more (default 300).

Which stage a cancel hit is read from what the client saw, not assumed from when it was sent:
0 tokens delivered = before or during the prefill; exactly 1 (the prefill's first token, decode has
produced nothing yet) = during the handoff (DecodeStart, KV pull and import); 2 or more = during decode.
The prefill is made slow on purpose (--max-num-batched-tokens 32: a 200-token prompt takes 7 steps) so
that delayed cancels land inside it.
"""
from __future__ import annotations

import asyncio
import collections
import os
import random
from dataclasses import dataclass, field

import grpc
import pytest

from common.tokenizer import Tokenizer
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.hf_reference import hf_greedy
from tests.integration.leaks import assert_no_leaks, load_of
from tests.integration.processes import start_services, stop_cleanly
from tests.integration.test_router import make_text_model

NUM_REQUESTS = int(os.environ.get("DISAGG_CHAOS_REQUESTS", "300"))
CONCURRENCY = 32
STREAM_SIZE = 4  # requests per GenerateStream
MAX_TOKENS = 24
REQUEST_TIMEOUT_S = 60.0  # a request still open after this is a hang
ENV = {"OMP_NUM_THREADS": "1"}
WORKER_ARGS = ("--block-size", "16", "--num-kv-blocks", "1024", "--max-num-batched-tokens", "32")

_WORDS = ["river", "stone", "lamp", "harbour", "winter", "orchard", "copper", "signal", "garden", "thunder", "paper", "violin"]
SHORT_PROMPTS = ["The sea is", "Once upon a time there was a lighthouse keeper who", "GPUs are fast because",
                 "Bread needs flour, water and"]
LONG_PROMPTS = [" ".join(_WORDS[(i * seed) % len(_WORDS)] for i in range(190)) for seed in (1, 5, 7)]

# action → weight. "cancel" sends Cancel on a GenerateStream; on Generate the client cancels the call
# (a disconnect). "disconnect" always cancels the RPC; on a stream that ends all its requests.
ACTIONS = {"complete": 40, "cancel_at_start": 10, "cancel_in_prefill": 15, "cancel_at_first_token": 10,
           "cancel_in_decode": 15, "disconnect_in_decode": 10}
LONG_ACTIONS = {"cancel_in_prefill", "cancel_at_first_token"}


@dataclass
class Plan:
    request_id: str
    prompt: str
    action: str
    after_deltas: int = 0  # cancel_in_decode / disconnect_in_decode: cancel once this many deltas arrived
    delay_s: float = 0.0  # cancel_in_prefill: cancel this long after the start


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finished: common_pb2.Finished | None = None
    status: grpc.StatusCode | None = None  # the RPC's status when it ended with an error (disconnects)
    cancel_sent: bool = False
    started: bool = True  # False: a stream the client left before this request's start was written
    extra_after_finished: int = 0


def make_plans(count: int, rng: random.Random) -> list[Plan]:
    plans = []
    for i in range(count):
        action = rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
        prompts = LONG_PROMPTS if action in LONG_ACTIONS else SHORT_PROMPTS + LONG_PROMPTS
        plans.append(Plan(f"chaos-{i}", rng.choice(prompts), action, after_deltas=rng.randint(2, 8),
                          delay_s=rng.uniform(0.0, 0.03)))
    return plans


def _request(plan: Plan) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(request_id=plan.request_id, prompt=plan.prompt,
                                          sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS))


class ChaosClient:
    def __init__(self, address: str, plans: list[Plan], rng: random.Random):
        self.address = address
        self.plans = plans
        self.rng = rng
        self.outcomes = {p.request_id: Outcome() for p in plans}
        self.slots = asyncio.Semaphore(CONCURRENCY)

    async def run(self) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            units = []
            i = 0
            while i < len(self.plans):
                if self.rng.random() < 0.5:
                    units.append(self._unary(stub, self.plans[i]))
                    i += 1
                else:
                    group = self.plans[i:i + STREAM_SIZE]
                    units.append(self._stream(stub, group, disconnect=self.rng.random() < 0.1))
                    i += len(group)
            await asyncio.gather(*units)

    async def _unary(self, stub, plan: Plan) -> None:
        outcome = self.outcomes[plan.request_id]
        async with self.slots:
            call = stub.Generate(_request(plan), timeout=REQUEST_TIMEOUT_S)
            try:
                if plan.action == "cancel_at_start":
                    outcome.cancel_sent = call.cancel()
                elif plan.action == "cancel_in_prefill":
                    asyncio.get_running_loop().call_later(plan.delay_s, self._mark_cancel, outcome, call)
                deltas = 0
                async for response in call:
                    self._record(outcome, response)
                    deltas += response.HasField("delta")
                    if self._cancel_now(plan, deltas) and not outcome.cancel_sent:
                        outcome.cancel_sent = call.cancel()
            except asyncio.CancelledError:
                outcome.status = grpc.StatusCode.CANCELLED  # grpc.aio raises this on a call we cancelled
            except grpc.aio.AioRpcError as error:
                outcome.status = error.code()

    @staticmethod
    def _mark_cancel(outcome: Outcome, call) -> None:
        outcome.cancel_sent = call.cancel() or outcome.cancel_sent

    async def _stream(self, stub, group: list[Plan], disconnect: bool) -> None:
        call = stub.GenerateStream(timeout=REQUEST_TIMEOUT_S * 2)
        writing = asyncio.Lock()
        deltas = collections.Counter()
        open_ids = {p.request_id for p in group}
        plans = {p.request_id: p for p in group}
        holding: set[str] = set()  # requests on this stream holding a concurrency slot
        victim = group[-1].request_id if disconnect else None

        async def cancel(request_id: str) -> None:
            self.outcomes[request_id].cancel_sent = True
            async with writing:
                await call.write(generation_pb2.GenerateStreamRequest(cancel=common_pb2.Cancel(request_id=request_id)))

        async def start(plan: Plan) -> None:
            await self.slots.acquire()
            holding.add(plan.request_id)
            async with writing:
                await call.write(generation_pb2.GenerateStreamRequest(start=_request(plan)))
            self.outcomes[plan.request_id].started = True
            if plan.action == "cancel_at_start":
                await cancel(plan.request_id)
            elif plan.action == "cancel_in_prefill":
                await asyncio.sleep(plan.delay_s)
                await cancel(plan.request_id)

        for plan in group:
            self.outcomes[plan.request_id].started = False
        starts = [asyncio.create_task(start(p)) for p in group]
        try:
            async for response in call:
                outcome = self.outcomes[response.request_id]
                self._record(outcome, response)
                rid = response.request_id
                deltas[rid] += response.HasField("delta")
                plan = plans[rid]
                if response.HasField("finished"):
                    open_ids.discard(rid)
                    if rid in holding:
                        holding.discard(rid)
                        self.slots.release()
                    if not open_ids:
                        await asyncio.gather(*starts)
                        async with writing:
                            await call.done_writing()
                elif rid == victim and deltas[rid] >= plan.after_deltas:
                    for rid_ in open_ids:
                        self.outcomes[rid_].cancel_sent = True
                    call.cancel()  # the client goes away with requests in flight
                    break
                elif self._cancel_now(plan, deltas[rid]) and not outcome.cancel_sent:
                    await cancel(rid)
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as error:
            code = error.code() if isinstance(error, grpc.aio.AioRpcError) else grpc.StatusCode.CANCELLED
            for rid in open_ids:
                self.outcomes[rid].status = code
        finally:
            for task in starts:
                task.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
            for _ in holding:
                self.slots.release()
        if victim is not None:
            for rid in open_ids:
                self.outcomes[rid].status = grpc.StatusCode.CANCELLED

    @staticmethod
    def _cancel_now(plan: Plan, deltas: int) -> bool:
        if plan.action == "cancel_at_first_token":
            return deltas >= 1
        if plan.action in ("cancel_in_decode", "disconnect_in_decode"):
            return deltas >= plan.after_deltas
        return False

    @staticmethod
    def _record(outcome: Outcome, response: generation_pb2.GenerateResponse) -> None:
        if outcome.finished is not None:
            outcome.extra_after_finished += 1
        elif response.HasField("delta"):
            outcome.tokens += response.delta.token_ids
        else:
            outcome.finished = response.finished


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> str:
    return str(make_text_model(tmp_path_factory.mktemp("models") / "tiny-text"))


@pytest.fixture(scope="module")
def cluster(text_model):
    workers = start_services([("prefill", ("--model", text_model, *WORKER_ARGS)),
                              ("decode", ("--model", text_model, *WORKER_ARGS))], env=ENV)
    processes = list(workers)
    try:
        processes += start_services([("router", ("--model", text_model, "--prefill-workers", workers[0].address,
                                                 "--decode-workers", workers[1].address))], env=ENV)
        yield processes
    finally:
        stop_cleanly(processes)


def test_chaos_cancels_and_disconnects_leave_no_leak_and_correct_tokens(cluster, text_model):
    prefill, decode, router = cluster
    tokenizer = Tokenizer.from_model_dir(text_model)
    references = {p: hf_greedy(text_model, tokenizer.encode(p), MAX_TOKENS, stop_at_eos=True)[0]
                  for p in SHORT_PROMPTS + LONG_PROMPTS}
    assert all(len(tokenizer.encode(p)) >= 150 for p in LONG_PROMPTS)
    start_loads = [load_of(p) for p in (prefill, decode)]
    rng = random.Random(int(os.environ.get("DISAGG_CHAOS_SEED", "7")))
    plans = make_plans(NUM_REQUESTS, rng)
    client = ChaosClient(router.address, plans, rng)

    async def run_all() -> None:
        await asyncio.wait_for(client.run(), timeout=REQUEST_TIMEOUT_S * 3)  # a hang fails here

    asyncio.run(run_all())

    stages, by_action = collections.Counter(), collections.Counter()
    for plan in plans:
        outcome = client.outcomes[plan.request_id]
        expected = references[plan.prompt]
        assert outcome.extra_after_finished == 0, plan
        assert outcome.tokens == expected[:len(outcome.tokens)], (plan, outcome)  # never a wrong token
        finished = outcome.finished
        if finished is not None and finished.reason != common_pb2.FINISH_REASON_CANCELLED:
            assert finished.reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP), (plan, finished)
            assert outcome.tokens == expected, plan  # a cancel that came too late leaves the request whole
            assert finished.usage.completion_tokens == len(expected)
            stages["finished"] += 1
            continue
        assert outcome.cancel_sent, (plan, outcome)
        if not outcome.started:
            stages["never sent (its stream was disconnected first)"] += 1
            continue
        if finished is not None:  # a Cancel on a stream: a CANCELLED Finished with the usage so far
            assert finished.usage.completion_tokens == len(outcome.tokens), (plan, finished)
        else:  # a disconnect: the RPC ended CANCELLED on the client side
            assert outcome.status == grpc.StatusCode.CANCELLED, (plan, outcome)
        stage = {0: "cancelled before the first token (prefill)", 1: "cancelled in the handoff (pull)"}.get(
            len(outcome.tokens), "cancelled in decode")
        stages[stage] += 1
        by_action[plan.action, stage] += 1
    print(f"\n{NUM_REQUESTS} requests: {dict(stages)}\nby injected action: {dict(sorted(by_action.items()))}")
    assert stages["finished"] >= NUM_REQUESTS * 0.3
    assert stages["cancelled before the first token (prefill)"] > 0 and stages["cancelled in decode"] > 0
    if NUM_REQUESTS >= 300:
        assert stages["cancelled in the handoff (pull)"] > 0

    end_loads = assert_no_leaks([prefill, decode])
    for start, end in zip(start_loads, end_loads):
        assert (end.kv_blocks_total, end.kv_blocks_free) == (start.kv_blocks_total, start.kv_blocks_free)
    # The router still serves a normal request correctly.
    with router.channel() as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(
            _request(Plan("after", SHORT_PROMPTS[0], "complete")), timeout=30))
    assert [t for r in responses if r.HasField("delta") for t in r.delta.token_ids] == references[SHORT_PROMPTS[0]]

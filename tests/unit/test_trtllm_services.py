"""The prefill and decode services over `--engine trtllm` (issue #17): the real servicers on loopback in this
process, each with a TrtLlmEngine over a stand-in for TensorRT-LLM's LLM API (SamplingParams and
DisaggregatedParams with the RECORDED field names, trtllm_api_signatures.json). No TensorRT-LLM runs here: this
checks our wiring (the ref, the routing of a trtllm ref past KvPuller, mismatches, releases), not TensorRT-LLM.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

import grpc
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.interface import Engine, EngineFacts
from common.engine.start import start_engine
from common.engine.trtllm import ATTRIBUTE_PREFIX, KV_TRANSPORT, OPAQUE_STATE, TrtLlmEngine
from common.kv.layout import KvLayout
from common.kv.offer import ENGINE_DRIVEN_NUMBERS
from common.kv.paths import DataPlane
from common.kv.transports.trtllm import TrtLlmTransport
from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.decode.__main__ import SPEC as DECODE
from services.prefill.__main__ import SPEC as PREFILL
from services.kit.serving import start_server
from services.worker.service import EngineRole, WorkerServicer, WorkerState

API = json.loads((Path(__file__).parent / "trtllm_api_signatures.json").read_text())
LAYOUT = KvLayout(2, 2, 8, 4, "float32", "trtllm-tiny")
PROMPT = list(range(3, 22))
FIRST, OPAQUE = 42, b"\x00transceiver-state\xff"


def _recorded(name: str, fields: list[str]) -> type:
    return dataclasses.make_dataclass(name, [(f, Any, None) for f in fields], kw_only=True)


TRTLLM = SimpleNamespace(SamplingParams=_recorded("SamplingParams", API["SamplingParams"]["init_fields"]),
                         DisaggregatedParams=_recorded("DisaggregatedParams", API["DisaggregatedParams"]["fields"]))


class _Result:
    """A tensorrt_llm RequestOutput of `steps` (cumulative token ids); `hold` keeps it open after them."""

    def __init__(self, steps: list[list[int]], disagg: Any = None, hold: bool = False):
        self.steps, self.disagg, self.hold, self.aborted = steps, disagg, hold, asyncio.Event()

    def abort(self) -> None:
        self.aborted.set()

    async def __aiter__(self):
        for i, tokens in enumerate(self.steps):
            last = i == len(self.steps) - 1 and not self.hold
            completion = SimpleNamespace(token_ids=tokens, finish_reason="length" if last else None, logprobs=None,
                                         disaggregated_params=self.disagg if last else None)
            yield SimpleNamespace(outputs=[completion], finished=last)
        if self.hold:
            await self.aborted.wait()


class _Llm:
    """tensorrt_llm.LLM as both phases see it: context_only answers FIRST and its DisaggregatedParams;
    generation_only continues from them (as if its transceiver had brought the KV)."""

    def __init__(self, hold: bool = False):
        self.calls: list[Any] = []
        self.results: list[_Result] = []
        self.hold = hold

    def generate_async(self, inputs, sampling_params=None, streaming=False, disaggregated_params=None):
        self.calls.append(disaggregated_params)
        if disaggregated_params.request_type == "context_only":
            params = TRTLLM.DisaggregatedParams(request_type="context_only", first_gen_tokens=[FIRST],
                                                ctx_request_id=17, opaque_state=OPAQUE)
            result = _Result([[FIRST]], params)
        else:
            first = list(disaggregated_params.first_gen_tokens)
            result = _Result([first + [50], first + [50, 51], first + [50, 51, 52]], hold=self.hold)
        self.results.append(result)
        return result

    async def get_stats_async(self, timeout: float):
        yield {"kvCacheStats": {"maxNumBlocks": 64, "freeNumBlocks": 64}, "numQueuedRequests": 0}

    def shutdown(self) -> None:
        pass


def trtllm_engine(llm: _Llm) -> TrtLlmEngine:
    config = EngineConfig(model="/stand-in", engine="trtllm", session_ttl_s=30, block_size=LAYOUT.block_size)
    return TrtLlmEngine(TRTLLM, llm, EngineFacts(LAYOUT, 64, config, None, torch.device("cpu"), "trtllm"))


@dataclasses.dataclass
class Worker:
    state: WorkerState
    stub: Any  # a grpc.aio channel's stubs
    channel: grpc.aio.Channel

    @property
    def engine(self) -> Engine:
        return self.state.engine


@contextlib.asynccontextmanager
async def serving(spec: EngineRole, engine: Engine) -> AsyncIterator[Worker]:
    """One worker of `spec` on loopback, as the worker shell runs it (the engine attached by the role spec)."""
    state = WorkerState(spec.role, "m")
    args = argparse.Namespace(kv_pull_timeout=5.0, kv_load_failure_policy="fail")

    def add(server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(state, spec), server)
        spec.add_servicers(server, state, args)

    server = await start_server(add, spec.service_names, "127.0.0.1", 0)
    state.endpoint = f"127.0.0.1:{server.port}"
    channel = grpc.aio.insecure_channel(state.endpoint)
    try:
        await spec.attach(state, engine)
        await server.set_serving(True)
        stub = SimpleNamespace(worker=worker_pb2_grpc.WorkerStub(channel), store=worker_pb2_grpc.TensorStoreStub(channel),
                               prefiller=worker_pb2_grpc.PrefillerStub(channel),
                               decoder=worker_pb2_grpc.DecoderStub(channel))
        yield Worker(state, stub, channel)
    finally:
        await channel.close()
        await server.server.stop(0)
        await state.drain(5)
        for close in state.closers:
            await close()
        await spec.close(state)


async def prefill(worker: Worker) -> worker_pb2.PrefillResponse:
    request = worker_pb2.PrefillRequest(request_id="r", token_ids=PROMPT,
                                        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4))
    return await worker.stub.prefiller.Prefill(request, timeout=10)


def decode_start(prefilled: worker_pb2.PrefillResponse) -> worker_pb2.DecodeClientMessage:
    start = worker_pb2.DecodeStart(request_id="r", token_ids=PROMPT, first_token=prefilled.first_token,
                                   sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4),
                                   stop=common_pb2.StopConditions(ignore_eos=True))
    start.session.CopyFrom(prefilled.session)
    return worker_pb2.DecodeClientMessage(start=start)


async def decode(worker: Worker, start: worker_pb2.DecodeClientMessage) -> list[worker_pb2.DecodeServerMessage]:
    return [message async for message in worker.stub.decoder.Decode(iter([start]), timeout=10)]


async def sessions_of(worker: Worker, timeout_s: float = 5.0, until: int = 0) -> int:
    """The worker's pinned sessions, once they reach `until` (releases run in the background) or the time is up."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (count := (await worker.engine.load()).active_sessions) != until:
        if asyncio.get_running_loop().time() > deadline:
            return count
        await asyncio.sleep(0.02)
    return count


def test_the_trtllm_prefill_ref_carries_the_context_params_and_no_kv_data_plane_is_started():
    async def run():
        async with serving(PREFILL, trtllm_engine(_Llm())) as worker:
            prefilled = await prefill(worker)
            info = await worker.stub.worker.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as pulled:
                await worker.stub.store.Pull(worker_pb2.PullRequest(handle=prefilled.session.session_id)).read()
            return worker.state, prefilled, info, pulled.value, await sessions_of(worker, until=1)

    state, prefilled, info, pulled, pinned = asyncio.run(run())
    ref = prefilled.session
    assert prefilled.first_token == FIRST and isinstance(state.kv_path, TrtLlmTransport)  # from the registry
    assert ref.transfer_backend == common_pb2.TRANSFER_BACKEND_TRTLLM == ENGINE_DRIVEN_NUMBERS[KV_TRANSPORT]
    assert ref.attributes[f"{ATTRIBUTE_PREFIX}first_gen_tokens"] == str(FIRST)
    assert ref.attributes[f"{ATTRIBUTE_PREFIX}ctx_request_id"] == "17" and OPAQUE_STATE in ref.attributes
    assert "transfer_backends" not in ref.attributes  # no data-plane offer
    assert (ref.num_tokens, list(ref.block_ids), ref.fingerprint) == (len(PROMPT), [], LAYOUT.fingerprint)
    assert info.engine == "trtllm" and list(info.transfer_backends) == [common_pb2.TRANSFER_BACKEND_TRTLLM]
    assert pulled.code() == grpc.StatusCode.FAILED_PRECONDITION and "not TensorStore.Pull" in pulled.details()
    assert pinned == 1  # held for its decode worker


def test_a_trtllm_ref_goes_to_the_decode_engine_as_generation_only_params_and_the_session_is_released():
    decode_llm = _Llm()

    async def run():
        async with serving(PREFILL, trtllm_engine(_Llm())) as p, serving(DECODE, trtllm_engine(decode_llm)) as d:
            messages = await decode(d, decode_start(await prefill(p)))
            return messages, await sessions_of(p)

    messages, left = asyncio.run(run())
    (params,) = decode_llm.calls
    assert (params.request_type, params.first_gen_tokens, params.ctx_request_id, params.opaque_state) == (
        "generation_only", [FIRST], 17, OPAQUE)
    tokens = [t for m in messages[:-1] for t in m.delta.token_ids]
    finished = messages[-1].finished
    assert tokens == [50, 51, 52] and finished.reason == common_pb2.FINISH_REASON_LENGTH
    assert finished.usage.kv_transfer_backend == common_pb2.TRANSFER_BACKEND_TRTLLM
    assert left == 0  # decode released the prefill worker's session once its engine had the KV


def test_a_cancelled_trtllm_decode_aborts_the_engine_request_and_still_releases_the_session():
    decode_llm = _Llm(hold=True)

    async def run():
        async with serving(PREFILL, trtllm_engine(_Llm())) as p, serving(DECODE, trtllm_engine(decode_llm)) as d:
            call = d.stub.decoder.Decode(iter([decode_start(await prefill(p))]), timeout=10)
            first = await call.read()
            call.cancel()
            await asyncio.wait_for(decode_llm.results[0].aborted.wait(), 5)
            return first, await sessions_of(p)

    first, left = asyncio.run(run())
    got = list(first.delta.token_ids)  # the first step's token, with the next ones if they were waiting (merged)
    assert got and got == [50, 51, 52][:len(got)] and left == 0


def test_malformed_trtllm_attributes_are_invalid_argument_and_release_the_session():
    async def run():
        async with serving(PREFILL, trtllm_engine(_Llm())) as p, serving(DECODE, trtllm_engine(_Llm())) as d:
            start = decode_start(await prefill(p))
            start.start.session.attributes[f"{ATTRIBUTE_PREFIX}ctx_request_id"] = "not-a-number"
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await decode(d, start)
            return error.value, await sessions_of(p)

    error, left = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed TensorRT-LLM DisaggregatedParams" in error.details()
    assert left == 0


@pytest.fixture(scope="module")
def torch_config(tiny_llama) -> EngineConfig:
    return EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=64)


def test_a_trtllm_ref_at_a_torch_decode_worker_is_failed_precondition_naming_both_sides(torch_config):
    async def run():
        async with serving(PREFILL, trtllm_engine(_Llm())) as p, \
                serving(DECODE, await asyncio.to_thread(start_engine, torch_config)) as d:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await decode(d, decode_start(await prefill(p)))
            return error.value, await sessions_of(p), await d.engine.load(), d.state.kv_path

    error, left, load, decode_path = asyncio.run(run())
    assert isinstance(decode_path, DataPlane) and decode_path.exporter is None  # a KvSessionHost: our data plane
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "TRANSFER_BACKEND_TRTLLM" in error.details() and "TensorRT-LLM's cache transceiver" in error.details()
    assert "--engine torch" in error.details() and "KV data plane" in error.details()
    assert left == 0 and load.running == 0


def test_a_torch_ref_at_a_trtllm_decode_worker_is_failed_precondition_and_frees_the_prefill_blocks(torch_config):
    decode_llm = _Llm()

    async def run():
        async with serving(PREFILL, await asyncio.to_thread(start_engine, torch_config)) as p, \
                serving(DECODE, trtllm_engine(decode_llm)) as d:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await decode(d, decode_start(await prefill(p)))
            await sessions_of(p)
            return error.value, await p.engine.load(), p.state.kv_path, d.state.kv_path

    error, load, prefill_path, decode_path = asyncio.run(run())
    assert isinstance(prefill_path, DataPlane) and prefill_path.exporter is not None  # shares its cache
    assert isinstance(decode_path, TrtLlmTransport)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "KV data plane" in error.details() and "--engine trtllm" in error.details()
    assert "TRANSFER_BACKEND_TRTLLM" in error.details()
    assert load.active_sessions == 0 and load.kv_blocks_free == load.kv_blocks_total
    assert decode_llm.calls == []  # nothing reached the engine

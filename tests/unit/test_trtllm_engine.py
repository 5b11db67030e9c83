"""TrtLlmEngine's request flow over a stand-in for TensorRT-LLM's LLM API whose SamplingParams and
DisaggregatedParams are kw-only dataclasses with the RECORDED field names (trtllm_api_signatures.json), so a
wrongly named argument fails here. This checks our side of the calls, not TensorRT-LLM."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.interface import EngineFacts, EngineRequest, KvSessionHost, OwnKvTransport
from common.engine.request import FinishReason, RequestType, SamplingParams
from common.engine.trtllm import OPAQUE_STATE, TrtLlmEngine, TrtLlmDisaggParams
from common.errors import NotFound
from common.kv.layout import KvLayout

API = json.loads((Path(__file__).parent / "trtllm_api_signatures.json").read_text())


def _recorded(name: str, fields: list[str]) -> type:
    return dataclasses.make_dataclass(name, [(f, Any, None) for f in fields], kw_only=True)


class _Result:
    """A tensorrt_llm RequestOutput: async-iterable, cumulative outputs[0].token_ids, abort()."""

    def __init__(self, steps: list[list[int]], disagg: Any = None):
        self.steps, self.disagg, self.aborted = steps, disagg, False

    async def __aiter__(self):
        for i, tokens in enumerate(self.steps):
            last = i == len(self.steps) - 1
            completion = SimpleNamespace(token_ids=tokens, finish_reason="length" if last else None, logprobs=None,
                                         disaggregated_params=self.disagg if last else None)
            yield SimpleNamespace(outputs=[completion], finished=last)


class _Llm:
    def __init__(self):
        self.calls: list[dict] = []
        self.results: list[_Result] = []

    def generate_async(self, inputs, sampling_params=None, streaming=False, disaggregated_params=None):
        self.calls.append({"inputs": inputs, "sampling": sampling_params, "streaming": streaming,
                           "disagg": disaggregated_params})
        return self.results.pop(0)


@pytest.fixture
def engine():
    trtllm = SimpleNamespace(SamplingParams=_recorded("SamplingParams", API["SamplingParams"]["init_fields"]),
                             DisaggregatedParams=_recorded("DisaggregatedParams", API["DisaggregatedParams"]["fields"]))
    config = EngineConfig(model="/m", engine="trtllm", session_ttl_s=30)
    facts = EngineFacts(KvLayout(2, 2, 8, 16, "float32", "trtllm-x"), 64, config, None, torch.device("cpu"), "trtllm")
    return TrtLlmEngine(trtllm, _Llm(), facts)


async def _all(stream):
    return [out async for out in stream]


def test_context_only_pins_a_session_whose_attributes_carry_the_context_params(engine):
    disagg = SimpleNamespace(first_gen_tokens=[7], ctx_request_id=5, opaque_state=b"\x01\x02", draft_tokens=None)
    engine._llm.results.append(_Result([[7]], disagg))
    request = EngineRequest("r1", [1, 2, 3], SamplingParams(temperature=0), RequestType.CONTEXT_ONLY)
    outs = asyncio.run(_all(engine.generate(request)))
    call = engine._llm.calls[0]
    assert call["disagg"].request_type == "context_only" and call["streaming"] is False
    assert call["sampling"].top_k == 1 and call["sampling"].max_tokens == 61
    assert outs[-1].finish_reason is FinishReason.CONTEXT_DONE and outs[-1].new_token_ids == [7]
    session = asyncio.run(engine.session(outs[-1].session_id))
    assert (session.first_token, session.num_tokens, session.request_id) == (7, 3, "r1")
    assert asyncio.run(engine.session_attributes(session.session_id))[OPAQUE_STATE] == "AQI="
    assert asyncio.run(engine.release_session(session.session_id)) is True
    with pytest.raises(NotFound):
        asyncio.run(engine.session(session.session_id))
    # the transceiver moves the KV: no cache or leases for our data plane
    assert isinstance(engine, OwnKvTransport) and not isinstance(engine, KvSessionHost)


def test_generation_only_sends_the_handoff_and_streams_only_new_tokens(engine):
    disagg_params = TrtLlmDisaggParams(first_gen_tokens=(7,), ctx_request_id=5, opaque_state=b"\x01")
    engine._llm.results.append(_Result([[7, 8], [7, 8, 9]]))
    request = EngineRequest("r2", [1, 2, 3], SamplingParams(max_tokens=3), RequestType.GENERATION_ONLY,
                            kv_import=disagg_params, first_token=7)
    outs = asyncio.run(_all(engine.generate(request)))
    disagg = engine._llm.calls[0]["disagg"]
    assert (disagg.request_type, disagg.first_gen_tokens, disagg.ctx_request_id, disagg.opaque_state) == (
        "generation_only", [7], 5, b"\x01")
    assert [o.new_token_ids for o in outs] == [[8], [9]] and outs[-1].finish_reason is FinishReason.LENGTH


def test_leaving_the_stream_early_aborts_the_tensorrt_llm_request(engine):
    result = _Result([[4], [4, 5], [4, 5, 6]])
    result.abort = lambda: setattr(result, "aborted", True)
    engine._llm.results.append(result)

    async def first_only():
        stream = engine.generate(EngineRequest("r3", [1, 2], SamplingParams()))
        out = await stream.__anext__()
        await stream.aclose()
        return out

    assert asyncio.run(first_only()).new_token_ids == [4]
    assert result.aborted and not engine._running

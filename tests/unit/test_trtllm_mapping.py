"""--engine trtllm's mappings onto TensorRT-LLM's LLM API, checked against a RECORDED signature list
(tests/unit/trtllm_api_signatures.json: TensorRT-LLM's modules load its C++ runtime on import, so CI
cannot import them). Nothing here runs TensorRT-LLM itself."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.engine.config import EngineConfig
from common.engine.request import RequestType, SamplingParams
from common.engine.start import start_engine
from common.engine.trtllm import (KV_TRANSPORT, OPAQUE_STATE, KvEventTranslator, TrtLlmEngine, TrtLlmDisaggParams,
                                  disaggregated_kwargs, llm_kwargs, load_from_stats, sampling_kwargs)
from common.errors import FailedPrecondition, InvalidConfig, InvalidRequest
from common.kv import transport
from common.kv.block_hash import hash_blocks
from common.kv.offer import ENGINE_DRIVEN_NUMBERS
from common.kv.paths import DataPlane
from common.pb.disagg.v1 import common_pb2
from services.worker.engine_flags import add_engine_args, engine_argv

API = json.loads((Path(__file__).parent / "trtllm_api_signatures.json").read_text())
SAMPLING_FIELDS = set(API["SamplingParams"]["init_fields"])
DISAGG_FIELDS = set(API["DisaggregatedParams"]["fields"])
BS = 4


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0), SamplingParams(),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=3, repetition_penalty=1.1,
                   max_tokens=8, stop_token_ids=(2, 7), ignore_eos=True, logprobs=True, top_logprobs=5)])
def test_sampling_maps_onto_tensorrt_llm_sampling_params_fields(sampling):
    kwargs = sampling_kwargs(sampling, max_new_tokens=100)
    assert set(kwargs) <= SAMPLING_FIELDS, set(kwargs) - SAMPLING_FIELDS
    assert kwargs["max_tokens"] == (sampling.max_tokens or 100) and kwargs["detokenize"] is False


def test_greedy_is_top_k_one_and_sampling_keeps_every_knob():
    greedy = sampling_kwargs(SamplingParams(temperature=0), 50)
    assert greedy["top_k"] == 1 and "temperature" not in greedy  # TensorRT-LLM's greedy rule
    full = sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=3,
                                          repetition_penalty=1.1, stop_token_ids=(2,), logprobs=True,
                                          top_logprobs=0), 50)
    assert full == {"max_tokens": 50, "ignore_eos": False, "detokenize": False, "temperature": 0.7, "top_p": 0.9,
                    "top_k": 40, "min_p": 0.05, "stop_token_ids": [2], "seed": 3, "repetition_penalty": 1.1,
                    "logprobs": 1}
    assert sampling_kwargs(SamplingParams(max_tokens=500), 20)["max_tokens"] == 20  # capped by the context


def _context_params(opaque: bytes = b"\x00\xffstate\n") -> SimpleNamespace:
    """What a context_only output's DisaggregatedParams holds (the recorded fields, all else None)."""
    values = dict.fromkeys(DISAGG_FIELDS)
    values.update(request_type="context_only", first_gen_tokens=[42], ctx_request_id=1234, opaque_state=opaque,
                  disagg_request_id=99, ctx_dp_rank=0, ctx_info_endpoint="tcp://10.0.0.1:5555")
    return SimpleNamespace(**values)


def test_the_context_handoff_travels_in_session_attributes_and_back():
    disagg_params = TrtLlmDisaggParams.from_params(_context_params())
    attributes = disagg_params.attributes()
    assert all(k.startswith("trtllm.") and isinstance(v, str) for k, v in attributes.items())
    assert attributes[OPAQUE_STATE] == "AP9zdGF0ZQo="  # base64 of the opaque bytes
    assert TrtLlmDisaggParams.from_attributes({**attributes, "shm.host_id": "x"}) == disagg_params


def test_generation_only_gets_the_context_params_under_tensorrt_llm_names():
    disagg_params = TrtLlmDisaggParams.from_attributes(TrtLlmDisaggParams.from_params(_context_params()).attributes())
    kwargs = disaggregated_kwargs(RequestType.GENERATION_ONLY, disagg_params)
    assert set(kwargs) <= DISAGG_FIELDS, set(kwargs) - DISAGG_FIELDS
    assert kwargs == {"request_type": "generation_only", "first_gen_tokens": [42], "ctx_request_id": 1234,
                      "opaque_state": b"\x00\xffstate\n", "disagg_request_id": 99, "ctx_dp_rank": 0,
                      "ctx_info_endpoint": "tcp://10.0.0.1:5555"}
    assert disaggregated_kwargs(RequestType.CONTEXT_ONLY, None) == {"request_type": "context_only"}
    assert disaggregated_kwargs(RequestType.CONTEXT_AND_GENERATION, None) is None
    assert {t.value for t in RequestType} == set(API["DisaggregatedParams"]["request_types"])


def test_the_trtllm_engine_turns_a_refs_attributes_into_its_generation_only_import():
    disagg_params = TrtLlmDisaggParams.from_params(_context_params())
    assert TrtLlmEngine.kv_import_from_attributes(None, disagg_params.attributes()) == disagg_params
    with pytest.raises(InvalidRequest, match="first_gen_tokens"):
        TrtLlmEngine.kv_import_from_attributes(None, {"transfer_backends": "shm,grpc"})  # a data-plane ref's


@pytest.mark.parametrize("backend", [common_pb2.TRANSFER_BACKEND_UNSPECIFIED, common_pb2.TRANSFER_BACKEND_GRPC,
                                     common_pb2.TRANSFER_BACKEND_SHM, common_pb2.TRANSFER_BACKEND_CUDA_IPC,
                                     common_pb2.TRANSFER_BACKEND_NIXL])
def test_data_plane_refs_and_trtllm_refs_go_to_their_own_engines_only(backend):
    data_plane = DataPlane("torch", ("grpc",))
    trtllm = transport.engine_transport(KV_TRANSPORT, None, "trtllm")
    assert ENGINE_DRIVEN_NUMBERS == {KV_TRANSPORT: common_pb2.TRANSFER_BACKEND_TRTLLM}
    assert data_plane.carries(backend) and not data_plane.carries(common_pb2.TRANSFER_BACKEND_TRTLLM)
    assert trtllm.carries(common_pb2.TRANSFER_BACKEND_TRTLLM) and not trtllm.carries(backend)
    trtllm.check(common_pb2.KvSessionRef(session_id="s", endpoint="h:1",
                                         transfer_backend=common_pb2.TRANSFER_BACKEND_TRTLLM))
    with pytest.raises(FailedPrecondition) as refused:
        trtllm.check(common_pb2.KvSessionRef(session_id="s1", endpoint="h:1", transfer_backend=backend))
    assert "KV session s1" in str(refused.value) and "KV data plane" in str(refused.value)  # theirs
    assert "--engine trtllm" in str(refused.value) and "TRANSFER_BACKEND_TRTLLM" in str(refused.value)  # ours


def test_a_trtllm_ref_at_a_data_plane_worker_names_both_sides():
    ref = common_pb2.KvSessionRef(session_id="s2", endpoint="h:1", transfer_backend=common_pb2.TRANSFER_BACKEND_TRTLLM)
    with pytest.raises(FailedPrecondition) as refused:
        DataPlane("torch", ("grpc",)).check(ref)
    assert str(refused.value) == (
        "KV session s2 was exported with transfer_backend TRANSFER_BACKEND_TRTLLM, to be moved through TensorRT-LLM's "
        "cache transceiver (TRANSFER_BACKEND_TRTLLM), but this decode worker runs --engine torch, which imports KV "
        "only over the KV data plane (TensorStore: cuda_ipc, shm, nixl, grpc); run prefill and decode workers with "
        "the same --engine")


def test_generation_only_without_a_handoff_or_with_a_broken_one_is_invalid():
    with pytest.raises(InvalidRequest, match="DisaggregatedParams"):
        disaggregated_kwargs(RequestType.GENERATION_ONLY, None)
    with pytest.raises(InvalidRequest, match="first_gen_tokens"):
        TrtLlmDisaggParams.from_attributes({OPAQUE_STATE: "AAAA"})
    with pytest.raises(InvalidRequest, match="malformed"):
        TrtLlmDisaggParams.from_attributes({"trtllm.first_gen_tokens": "1", OPAQUE_STATE: "not base64!"})


def test_llm_arguments_are_tensorrt_llm_ones():
    config = EngineConfig(model="/m", dtype="bfloat16", device="cuda", block_size=32, gpu_memory_utilization=0.8,
                          session_ttl_s=30, engine="trtllm", tensor_parallel_size=2)
    kwargs = llm_kwargs(config, 4096)
    assert kwargs["tensor_parallel_size"] == 2
    args = API["LlmArgs"]
    assert set(kwargs) <= set(args["BaseLlmArgs"])
    assert set(kwargs["kv_cache_config"]) <= set(args["KvCacheConfig"])
    assert set(kwargs["cache_transceiver_config"]) <= set(args["CacheTransceiverConfig"])
    assert kwargs["cache_transceiver_config"]["backend"] in args["CacheTransceiverConfig.backend"]
    assert kwargs["kv_cache_config"] == {"enable_block_reuse": True, "tokens_per_block": 32,
                                         "event_buffer_max_size": 1024, "free_gpu_memory_fraction": 0.8}
    assert kwargs["cache_transceiver_config"]["kv_transfer_timeout_ms"] == 30_000 and kwargs["max_seq_len"] == 4096


def _stored(parent, blocks, first_hash=1000):
    """A KVCacheEventSerializer 'stored' event (the recorded key names)."""
    keys = API["KVCacheEventSerializer"]["data_types"]
    assert keys["stored"] == ["type", "parent_hash", "blocks"]
    return {"event_id": 1, "window_size": 64, "data": {"type": "stored", "parent_hash": parent, "blocks": [
        {"type": "stored_block", "block_hash": first_hash + i, "cache_level": 0, "priority": 35,
         "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in block]}
        for i, block in enumerate(blocks)]}}


def test_kv_events_are_rekeyed_to_our_chained_block_hashes():
    tokens = list(range(100, 112))  # three full blocks of 4
    ours = hash_blocks(tokens, BS)
    t = KvEventTranslator(BS)
    assert t.translate({"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [64, 0]}}) == [("cleared",)]
    assert t.translate(_stored(None, [tokens[0:4], tokens[4:8]])) == [("stored", ours[:2], None, 8)]
    # a later event extends the chain from its parent (its hash 1001 = our second block); a partial block is not announced
    assert t.translate(_stored(1001, [tokens[8:12], [1, 2]], first_hash=2000)) == [("stored", ours[2:], ours[1], 4)]
    assert t.translate({"event_id": 4, "data": {"type": "removed", "block_hashes": [2000, 2001, 777]}}) == [
        ("removed", [ours[2]])]
    assert t.translate({"event_id": 5, "data": {"type": "updated", "block_hash": 1000}}) == []
    assert t.translate(_stored(555, [tokens[0:4]])) == []  # an unknown parent: nothing we can key


def test_load_comes_from_tensorrt_llm_iteration_stats():
    load = load_from_stats({"numQueuedRequests": 3, "kvCacheStats": {"maxNumBlocks": 100, "freeNumBlocks": 25}},
                           running=2, sessions=1, expired=4)
    assert (load.waiting, load.kv_blocks_total, load.kv_blocks_free, load.kv_usage_ratio) == (3, 100, 25, 0.75)
    assert load_from_stats(None, 0, 0, 0).kv_usage_ratio == 0.0


def test_engine_flag_selects_trtllm_and_says_plainly_when_it_is_not_installed(tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--engine", "trtllm", "--model", str(tmp_path)])
    argv = engine_argv(args)
    assert argv[argv.index("--engine") + 1] == "trtllm" and args.engine == "trtllm"
    with pytest.raises(InvalidConfig, match="--engine must be one of"):
        EngineConfig(model="/m", engine="vllm")
    with pytest.raises(InvalidConfig, match="TensorRT-LLM is not installed; --engine trtllm needs NVIDIA's"):
        start_engine(EngineConfig(model=str(tmp_path), engine="trtllm"))

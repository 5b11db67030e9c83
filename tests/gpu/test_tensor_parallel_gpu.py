"""Tensor parallelism on two GPUs of one host (NCCL): TP=2 greedy equals TP=1 and Hugging Face with CUDA graphs and
async scheduling on, a session moves between TP sizes in-process and between real worker processes over cuda_ipc
token for token, and cancels free every block. Skipped with fewer than two CUDA GPUs.

    python -m pytest -q -s tests/gpu/test_tensor_parallel_gpu.py      # on a machine with two GPUs
"""
from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)
try:
    from common.pb.disagg.v1 import worker_pb2_grpc  # noqa: F401
except RuntimeError as exc:  # the generated code needs a newer grpcio than this machine has
    pytest.skip(str(exc).splitlines()[0], allow_module_level=True)

from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import LLMEngine  # noqa: E402
from common.engine.request import SamplingParams  # noqa: E402
from common.kv.shards import KvShards  # noqa: E402
from tests.hf_reference import hf_greedy  # noqa: E402
from tests.integration.kv_transport_cases import (transport_cluster, check_cancels_free_everything,  # noqa: E402
                                                check_handoff)
from tests.unit.test_kv_handoff import _decode, _prefill  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the machine's rule: no NVLink multicast (its followers inherit it)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
FAMILIES = ["llama-gqa", "qwen2-bias", "qwen3-qknorm", "phi3"]  # mistral is llama's code with a window
PROMPT = list(range(3, 40))  # 37 tokens: ten blocks of 4, the last partial
TP2 = ("--tensor-parallel-size", "2")


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _engine(path: str, tp: int, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cuda", tensor_parallel_size=tp,
                                  **{"block_size": 4, "num_kv_blocks": 128, "max_num_seqs": 8, **overrides}))


def _counting_ahead(engine: LLMEngine) -> list:
    ahead, launch_ahead = [], engine.runner.launch_ahead
    engine.runner.launch_ahead = lambda prev, rows, joined=(): ahead.append(rows) or launch_ahead(prev, rows, joined)
    return ahead


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_greedy_equals_tp1_and_hf_with_graphs_and_async_scheduling(tiny_model_dirs, family):
    path = tiny_model_dirs[family]
    prompts = _prompts([5, 11, 23, 2])
    engine = _engine(path, 2, long_prefill_token_threshold=8)
    try:
        assert engine.runner.graphs is not None and engine.async_scheduling
        assert isinstance(engine.kv_cache, KvShards) and len(engine.kv_cache.shards) == 2
        ahead = _counting_ahead(engine)
        got = engine.generate(prompts, GREEDY)
        assert ahead, "no step was launched ahead"
        assert engine.block_manager.num_free_blocks == 128
    finally:
        engine.close()
    reference = _engine(path, 1)
    assert got == reference.generate(prompts, GREEDY)
    assert got == [hf_greedy(path, p, 12)[0] for p in prompts]


@pytest.fixture(scope="module")
def engines(tiny_model_dirs) -> Iterator[dict[int, LLMEngine]]:
    engines = {tp: _engine(tiny_model_dirs["llama-gqa"], tp) for tp in (1, 2)}
    yield engines
    engines[2].close()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_a_session_exported_at_one_tp_size_decodes_at_another_in_process(engines, prefill_tp, decode_tp):
    prompt = _prompts([19], seed=5)[0]
    want = engines[1].generate([prompt], GREEDY)[0]
    prefill, decode = engines[prefill_tp], engines[decode_tp]
    out = _prefill(prefill, prompt, GREEDY)
    kv = prefill.export_session(out.session_id)
    prefill.release_session(out.session_id)
    assert _decode(decode, prompt, out.new_token_ids[0], kv, GREEDY) == want
    assert prefill.block_manager.num_free_blocks == decode.block_manager.num_free_blocks == 128


@pytest.fixture(scope="module")
def cluster(tiny_llama) -> Iterator[dict]:
    """prefill TP=1 on GPU 0 ("prefill"), decode TP=1 over cuda_ipc ("cuda_ipc"), prefill TP=2 on GPUs 0-1
    ("extra0") and decode TP=2 on GPUs 0-1 over cuda_ipc ("extra1")."""
    args = ("--model", tiny_llama, "--device", "cuda", "--block-size", "4", "--num-kv-blocks", "64",
            "--max-num-seqs", "8")
    extra = [("prefill", (*args, *TP2)), ("decode", (*args, *TP2, "--kv-transports", "cuda_ipc"))]
    with transport_cluster(args, ["cuda_ipc"], extra) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama, device="cuda", block_size=4, num_kv_blocks=64, max_num_seqs=8))


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2)])
def test_workers_hand_off_across_tp_sizes_over_cuda_ipc(cluster, reference, prefill_tp, decode_tp):
    prefill = cluster["extra0" if prefill_tp == 2 else "prefill"]
    decode = cluster["extra1" if decode_tp == 2 else "cuda_ipc"]
    usage = check_handoff(prefill, decode, reference, PROMPT, "cuda_ipc")
    print(f"\nprefill TP={prefill_tp} -> decode TP={decode_tp} over cuda_ipc: {usage.kv_transfer_bytes} B in "
          f"{usage.kv_transfer_ms:.2f} ms")


def test_cancels_free_every_block_of_every_rank_across_gpus(cluster):
    check_cancels_free_everything(cluster["extra0"], cluster["extra1"], PROMPT)

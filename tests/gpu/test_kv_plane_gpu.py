"""The KV data plane on a GPU, between real prefill and decode processes: cuda_ipc (GPU→GPU, no host
copy, straight into decode's blocks), nixl (VRAM, when NIXL runs) and grpc (side-stream gather into pinned
memory) each give the aggregated engine's greedy tokens, cancels leave no block held on either worker, and a
cuda_ipc read of blocks the exporter reused is detected and recomputed, never served. Skipped without CUDA.

    python -m pytest -q -s tests/gpu/test_kv_plane_gpu.py      # on the GPU machine
"""
from __future__ import annotations

from typing import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
try:
    from common.pb.disagg.v1 import worker_pb2_grpc  # noqa: F401
except RuntimeError as exc:  # the generated code needs a newer grpcio than this machine has
    pytest.skip(str(exc).splitlines()[0], allow_module_level=True)

from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import LLMEngine  # noqa: E402
from common.kv.transports.nixl import nixl_unavailable_reason  # noqa: E402
from common.engine.request import SamplingParams  # noqa: E402
from common.pb.disagg.v1 import worker_pb2  # noqa: E402
from tests.integration.kv_transport_cases import (transport_cluster, check_cancels_free_everything, check_handoff,  # noqa: E402
                                                decode_start, prefill)
from tests.integration.worker_client import assert_pool_full, split  # noqa: E402

ENGINE_ARGS = ("--device", "cuda", "--block-size", "4", "--num-kv-blocks", "64")
PROMPT = list(range(3, 40))  # 37 tokens: ten blocks of 4, the last partial
TRANSPORTS_HERE = ["cuda_ipc", *(["nixl"] if nixl_unavailable_reason() is None else []), "grpc"]


@pytest.fixture(scope="module")
def cluster(tiny_llama) -> Iterator[dict]:
    with transport_cluster(("--model", tiny_llama, *ENGINE_ARGS), TRANSPORTS_HERE) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama, device="cuda", block_size=4, num_kv_blocks=64))


@pytest.mark.parametrize("transport", TRANSPORTS_HERE)
def test_each_transport_on_the_gpu_hands_off_the_aggregated_tokens(cluster, reference, transport):
    usage = check_handoff(cluster["prefill"], cluster[transport], reference, PROMPT, transport, max_tokens=24)
    print(f"{transport}: {usage.kv_transfer_bytes} bytes in {usage.kv_transfer_ms:.3f} ms")


def test_cuda_ipc_is_chosen_when_both_workers_share_the_gpu(cluster, reference):
    check_handoff(cluster["prefill"], cluster["decode_any"], reference, PROMPT, "cuda_ipc")


@pytest.mark.parametrize("transport", TRANSPORTS_HERE)
def test_cancels_on_the_gpu_free_every_block_on_both_workers(cluster, transport):
    check_cancels_free_everything(cluster["prefill"], cluster[transport], PROMPT)


def test_a_cuda_ipc_read_of_reused_blocks_is_recomputed_never_served(cluster, reference):
    expected = reference.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    stale = prefill(cluster["prefill"], PROMPT, 24)
    store = cluster["prefill"].store
    assert store.Release(worker_pb2.ReleaseRequest(handle=stale.session.session_id), timeout=10).released
    for i in range(8):  # 8 prompts of ten blocks each cycle through all 64 blocks of the exporter's pool
        other = prefill(cluster["prefill"], [7 + i] * 37, 2)
        store.Release(worker_pb2.ReleaseRequest(handle=other.session.session_id), timeout=10)
    messages = cluster["cuda_ipc"].decoder.Decode(iter([decode_start(stale, PROMPT, 24)]), timeout=60)
    tokens, finished = split(messages)
    assert [stale.first_token, *tokens] == expected  # recomputed from the prompt, not decoded on reused blocks
    assert finished.usage.kv_transfer_bytes == 0  # nothing pulled was used
    for client in (cluster["prefill"], cluster["cuda_ipc"]):
        assert_pool_full(client)

"""Workers on the GPU they are given (`--device cuda:N`): one on the last visible GPU serves HF-identical tokens,
and a session prefilled on GPU 0 decodes on the last GPU over cuda_ipc (a peer copy across GPUs where there are
two or more) token for token, with every block freed after cancels. Skipped without CUDA.

    python -m pytest -q -s tests/gpu/test_multi_gpu.py
"""
from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import LLMEngine  # noqa: E402
from common.engine.request import SamplingParams  # noqa: E402
from tests.hf_reference import hf_greedy  # noqa: E402
from tests.integration.kv_transport_cases import (transport_cluster, check_cancels_free_everything,  # noqa: E402
                                                check_handoff)

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
LAST = f"cuda:{torch.cuda.device_count() - 1}"
PROMPT = list(range(3, 70))  # 67 tokens: 17 blocks of 4, the last partial


@pytest.fixture(scope="module")
def cluster(tiny_llama) -> Iterator[dict]:
    """prefill on cuda:0 ("prefill"); decode on the last GPU accepting only cuda_ipc ("cuda_ipc")."""
    common = ("--model", tiny_llama, "--block-size", "4", "--num-kv-blocks", "64", "--max-num-seqs", "8")
    decode_last = ("decode", (*common, "--device", LAST, "--kv-transports", "cuda_ipc"))
    with transport_cluster((*common, "--device", "cuda:0"), [], [decode_last]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama, device=LAST, block_size=4, num_kv_blocks=64, max_num_seqs=8))


def test_an_engine_on_the_last_gpu_keeps_its_work_there(reference, tiny_llama):
    assert reference.runner.device == torch.device(LAST)
    assert reference.kv_cache.device == torch.device(LAST)
    out = reference.generate([PROMPT[:9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out == hf_greedy(tiny_llama, PROMPT[:9], 4)[0]


def test_an_engine_on_gpu0_after_one_on_the_last_gpu_captures_its_graphs_on_gpu0(reference, tiny_llama):
    """torch.cuda.graph's default capture stream is made once a process, on the GPU current at the first capture
    (the last one, by `reference`): a second engine's graphs must not be captured there (#36: they read the wrong
    GPU's memory once peer access was on, and one token came out repeated)."""
    from common.kv.transports.cuda_ipc.peer_copy import enable_peer_access

    if torch.cuda.device_count() > 1:  # peer access on turns the launch error into wrong tokens: test the worse
        enable_peer_access(torch.device("cuda:0"), torch.device(LAST))
    first = LLMEngine(EngineConfig(model=tiny_llama, device="cuda:0", block_size=4, num_kv_blocks=64, max_num_seqs=8))
    assert first.runner.graphs is not None  # the decode steps below replay graphs
    out = first.generate([PROMPT[:9]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out == hf_greedy(tiny_llama, PROMPT[:9], 8)[0]


def test_prefill_on_gpu0_decodes_on_the_last_gpu_over_cuda_ipc(cluster, reference):
    usage = check_handoff(cluster["prefill"], cluster["extra0"], reference, PROMPT, "cuda_ipc")
    print(f"\ncuda:0 -> {LAST} over cuda_ipc: {usage.kv_transfer_bytes} B in {usage.kv_transfer_ms:.2f} ms")


def test_cancels_free_every_block_across_gpus(cluster):
    check_cancels_free_everything(cluster["prefill"], cluster["extra0"], PROMPT)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("on", ["auto", "dst", "src", "copy_engine"])
@pytest.mark.parametrize("order", ["consecutive", "shuffled"])
def test_peer_block_copier_moves_exactly_the_blocks_asked_for(on, order):
    from common.kv.transports.cuda_ipc.peer_copy import PeerBlockCopier

    src = torch.randn((3, 2, 40, 4, 2, 8), device="cuda:0")
    dst = torch.zeros((3, 2, 50, 4, 2, 8), device=LAST)
    g = torch.Generator().manual_seed(1)
    src_ids, dst_ids = ((list(range(5, 17)), list(range(30, 42))) if order == "consecutive"
                        else (torch.randperm(40, generator=g)[:12].tolist(), torch.randperm(50, generator=g)[:12].tolist()))
    copier = PeerBlockCopier(src, dst, on=on)
    _settle()
    stream = torch.cuda.Stream(device=copier.device)
    kept = copier(src_ids, dst_ids, stream)
    stream.synchronize()
    del kept
    assert torch.equal(dst[:, :, dst_ids].cpu(), src[:, :, src_ids].cpu())
    untouched = [i for i in range(50) if i not in dst_ids]
    assert not dst[:, :, untouched].any()


def _settle() -> None:
    """Every GPU's queued work done: the caches' fill (randn, zeros, the shards' copies) ran on the default streams,
    which a new stream does not wait for (PyTorch's streams are non-blocking), so a copy enqueued at once could read
    or be overwritten by it. An engine's cache was written long before any pull reads it."""
    for device in range(torch.cuda.device_count()):
        torch.cuda.synchronize(device)


def _split(full: torch.Tensor, parts: int) -> "KvShards":
    """`full`'s heads over `parts` shards, shard r on GPU r (mod the GPUs there are), as a TP engine's ranks hold
    them."""
    from common.kv.shards import KvShards

    h = full.shape[4] // parts
    return KvShards([full[:, :, :, :, r * h:(r + 1) * h].contiguous().to(f"cuda:{r % torch.cuda.device_count()}")
                     for r in range(parts)])


@pytest.mark.parametrize(("src_parts", "dst_parts"), [(2, 1), (1, 2), (2, 2), (4, 2)])
@pytest.mark.parametrize("order", ["consecutive", "shuffled"])
def test_head_slice_copier_moves_every_heads_blocks_in_one_hop(src_parts, dst_parts, order):
    """Between a TP exporter's shards and an importer of another TP size (1 = one plain cache on the last GPU), the
    copy engines move exactly the blocks asked for, each head into the shard that holds it."""
    from common.kv.transports.cuda_ipc.block_copy import BlockCopier

    full = torch.randn((3, 2, 40, 4, 8, 16), device="cuda:0")
    src = _split(full, src_parts) if src_parts > 1 else full.to(LAST)
    dst_full = torch.zeros((3, 2, 50, 4, 8, 16), device=LAST)
    dst = _split(dst_full, dst_parts) if dst_parts > 1 else dst_full
    g = torch.Generator().manual_seed(2)
    src_ids, dst_ids = ((list(range(5, 17)), list(range(30, 42))) if order == "consecutive"
                        else (torch.randperm(40, generator=g)[:12].tolist(), torch.randperm(50, generator=g)[:12].tolist()))
    copier = BlockCopier(src, dst)
    assert copier.peer is not None and len(copier.peer.pieces) == max(src_parts, dst_parts)
    _settle()
    stream = torch.cuda.Stream(device=copier.device)
    assert copier(src_ids, dst_ids, stream) is None
    stream.synchronize()
    got = (torch.cat([s.cpu() for s in dst.shards], dim=4) if dst_parts > 1 else dst.cpu())
    assert torch.equal(got[:, :, dst_ids], full[:, :, src_ids].cpu())
    untouched = [i for i in range(50) if i not in dst_ids]
    assert not got[:, :, untouched].any()

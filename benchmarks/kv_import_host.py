"""The host's share of a cuda_ipc pull, measured without a GPU: KvPuller.pull_and_release of a session straight into
blocks of a local pool (cuda_ipc), the exporter's cache already mapped and its copy stubbed out, so what is
timed is the Python and event-loop work around the copy kernel: negotiation, the checks, the reservation, the fence.

    python -m benchmarks.kv_import_host [--tokens 1500] [--repeats 2000]

The 3B shape of benchmarks.gpu_kv_plane (28 layers, 8 KV heads of 128, blocks of 16, 4096 blocks each side).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from common.engine.block_manager import BlockManager
from common.kv import fence, host
from common.kv.fence import EPOCH_ATTRIBUTE, EPOCHS_ATTRIBUTE
from common.kv.layout import PlacedKv
from common.kv.offer import KV_CACHE_ID_ATTRIBUTE, OFFERED_ATTRIBUTE
from common.kv.pull import KvPuller
from common.kv.transports.cuda_ipc.mapping import MappedCache
from common.kv.wire import ChannelCache
from common.pb.disagg.v1 import common_pb2

ENDPOINT, CACHE_ID, NUM_BLOCKS, BLOCK_SIZE = "127.0.0.1:1", "bench-cache", 4096, 16


class _NoCopy:
    """The copy kernel's stand-in: the host path around it is what is timed."""

    def __init__(self, src: torch.Tensor):
        self.src = src

    def __call__(self, src_ids, dst_ids) -> None:
        pass


def _puller(cache: torch.Tensor, epochs: fence.BlockEpochs) -> KvPuller:
    puller = KvPuller(ChannelCache(), cache.device, ("cuda_ipc",), blocks=BlockManager(NUM_BLOCKS, BLOCK_SIZE)
                      .kv_blocks(cache), self_check=False)
    transport = puller.transports["cuda_ipc"] = cuda_ipc_transport()
    mapped = MappedCache(CACHE_ID, cache, fence.BlockEpochs.open(str(epochs.path), NUM_BLOCKS), _NoCopy(cache))
    transport._mappings._mapped[ENDPOINT] = mapped
    puller.releases.later = lambda ref: None  # no exporter to answer it
    return puller


def cuda_ipc_transport():
    from common.kv.transports.cuda_ipc import CudaIpcTransport

    transport = CudaIpcTransport()
    transport.applies = lambda ref: True  # no GPU here to match the ref's
    return transport


def _ref(tokens: int, epochs: fence.BlockEpochs) -> common_pb2.KvSessionRef:
    block_ids = list(range(100, 100 + -(-tokens // BLOCK_SIZE)))
    attributes = {OFFERED_ATTRIBUTE: "cuda_ipc,shm,nixl,grpc", KV_CACHE_ID_ATTRIBUTE: CACHE_ID,
                  host.HOST_ID_ATTRIBUTE: host.host_id() or "host", "cuda_device_uuid": "GPU-bench",
                  EPOCHS_ATTRIBUTE: str(epochs.path), EPOCH_ATTRIBUTE: str(epochs.total(block_ids))}
    return common_pb2.KvSessionRef(
        session_id="0" * 32, request_id="r", endpoint=ENDPOINT, transfer_backend=common_pb2.TRANSFER_BACKEND_CUDA_IPC,
        num_layers=28, num_kv_heads=8, head_dim=128, block_size=BLOCK_SIZE, dtype="bfloat16", num_tokens=tokens,
        block_ids=block_ids, fingerprint="f" * 16, attributes=attributes)


async def _bench(tokens: int, repeats: int) -> dict:
    cache = torch.empty(28, 2, NUM_BLOCKS, 1, 1, 1, dtype=torch.bfloat16)  # the shape's planes; blocks never read
    epochs = fence.BlockEpochs.create(NUM_BLOCKS)
    puller = _puller(cache, epochs)
    ref = _ref(tokens, epochs)
    times = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            pulled = await puller.pull_and_release(ref, timeout_s=60)
            times.append(time.perf_counter() - start)
            assert isinstance(pulled.export, PlacedKv)
            pulled.export.discard()
    finally:
        await puller.close()
        epochs.close()
    times.sort()
    return {"bench": "kv_import_host", "tokens": tokens, "blocks": len(ref.block_ids), "repeats": repeats,
            "median_us": round(statistics.median(times) * 1e6, 1), "p10_us": round(times[len(times) // 10] * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(_bench(args.tokens, args.repeats))))


if __name__ == "__main__":
    main()

"""Where a decode worker's cuda_ipc import spends its time, step by step, reading another process's cache:

    python -m benchmarks.kv_import_trace --tokenizer-from DIR [--shape llama-3.2-3b] [--tokens 1500] [--repeats 20]

It starts a real prefill worker and maps its cache as a decode worker does (CudaIpcTransport.map_cache). It then
imports sessions into a pool of this process's own, stamping each step of cuda_ipc's direct.import_placed with the
host clock: reserve, the copy's launch (its block ids included), the event, the wait, the fence. Three cases:
- `after_prefill`: a new session each time, imported right after the worker's prefill (a decode worker's case:
  it waited for the prefill);
- `again`: the same session imported again and again, nothing in between;
- `local`: a cache of this process's own, of the same shape (no second process at all).
Each case is run as the import runs (gather.wait_event), with a bare spin on the event instead, and with the block
ids uploaded from pinned memory instead of read in place. Beside them: the copy kernel's GPU time on the mapped
and on the local cache (its ids read in place, and on the GPU), and the host's round trip to the GPU (an event
recorded on an idle stream, until the host sees it) right after the worker's prefill, 5 ms after it, after the
bench thread slept 30 ms, and with nothing in between. Medians, µs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.interface import KvBlocks  # noqa: E402
from common.kv import gather  # noqa: E402
from common.kv.blocks import pinned_ids  # noqa: E402
from common.kv.fence import EPOCH_ATTRIBUTE, BlockEpochs, fence_of  # noqa: E402
from common.kv.transports.cuda_ipc import CudaIpcTransport  # noqa: E402
from common.kv.transports.cuda_ipc.block_copy import BlockCopier  # noqa: E402
from common.kv.wire import ChannelCache, release_quietly  # noqa: E402
from common.pb.disagg.v1 import common_pb2, worker_pb2_grpc  # noqa: E402
from benchmarks.gpu_kv_plane import local_blocks, model_dir, prefill_session, pull_backend  # noqa: E402
from benchmarks.kv_import_phases import gpu_ms  # noqa: E402
from benchmarks.processes import start_service  # noqa: E402

STEPS = ("reserve", "copy", "event", "wait", "fence", "total")


async def spin(event: torch.cuda.Event) -> None:
    while not event.query():
        pass


def in_place(copier: BlockCopier, src_ids: list[int], dst_ids: list[int], stream: torch.cuda.Stream) -> torch.Tensor:
    return copier(src_ids, dst_ids, stream)  # the copier's own way: the kernel reads the ids over the bus


def uploaded(copier: BlockCopier, src_ids: list[int], dst_ids: list[int], stream: torch.cuda.Stream) -> None:
    return copier(src_ids, dst_ids, stream, upload=True)


async def stamped_import(copier: BlockCopier, epochs: BlockEpochs, ref: common_pb2.KvSessionRef, blocks: KvBlocks,
                         wait: Callable[[torch.cuda.Event], Awaitable[None]], copy=in_place) -> list[float]:
    """import_placed's steps, each stamped (µs); the blocks go back to the pool afterwards."""
    stamps = [time.perf_counter()]
    reserved = blocks.reserve(-(-(ref.num_tokens + 1) // ref.block_size))
    stamps.append(time.perf_counter())
    src_ids, dst_ids = list(ref.block_ids), reserved[: len(ref.block_ids)]
    stream = gather.side_stream(copier.src.device)
    reading = copy(copier, src_ids, dst_ids, stream)
    stamps.append(time.perf_counter())
    event = gather.recorded_event(stream)
    stamps.append(time.perf_counter())
    await wait(event)
    gather.recycle_event(event)
    del reading
    stamps.append(time.perf_counter())
    epochs.check(src_ids, fence_of(ref), "trace")
    stamps.append(time.perf_counter())
    blocks.free(reserved)
    steps = [(b - a) * 1e6 for a, b in zip(stamps, stamps[1:])]
    return [*steps, (stamps[-1] - stamps[0]) * 1e6]


def medians(rows: list[list[float]]) -> dict[str, float]:
    return {step: round(statistics.median(column), 1) for step, column in zip(STEPS, zip(*rows))}


def kernel_us(copier: BlockCopier, ids: list[int], pinned: bool) -> float:
    """GPU time of the copy kernel alone, its block ids read in place from pinned host memory (as a pull does) or
    from GPU memory."""
    stream = gather.side_stream(copier.src.device)
    block_ids = pinned_ids(ids, range(len(ids)))
    if not pinned:
        block_ids = block_ids.to(copier.src.device)
    with torch.cuda.stream(stream):
        return round(gpu_ms(lambda: copier.kernel(block_ids, len(ids), stream), repeats=20) * 1e3, 1)


def round_trip_us() -> float:
    """An event recorded on the idle side stream, until the host sees it."""
    start = time.perf_counter()
    event = torch.cuda.Event()
    event.record(gather.side_stream(torch.device("cuda")))
    while not event.query():
        pass
    return (time.perf_counter() - start) * 1e6


async def trace(address: str, tokens: int, repeats: int) -> dict:
    rng = random.Random(0)
    figures: dict = {}
    with grpc.insecure_channel(address) as sync_channel:
        stub = worker_pb2_grpc.PrefillerStub(sync_channel)
        ref = prefill_session(stub, tokens, rng)
        transport, channels = CudaIpcTransport(), ChannelCache()
        channel = channels.get(ref.endpoint)
        mapped = await transport.map_cache(channel, ref)
        blocks = local_blocks(ref, 4 * len(ref.block_ids))
        copier = BlockCopier(mapped.tensor, blocks.cache)
        for name, wait, copy in (("wait_event", gather.wait_event, in_place), ("spin", spin, in_place),
                                 ("ids_uploaded", gather.wait_event, uploaded)):
            rows = []
            for _ in range(repeats + 1):
                session = prefill_session(stub, tokens, rng)
                rows.append(await stamped_import(copier, mapped.epochs, session, blocks, wait, copy))
                if ref is not session:
                    await release_quietly(channel, ref.session_id)  # the last one stays, for `again`
                ref = session
            figures[f"after_prefill_{name}"] = medians(rows[1:])
            rows = [await stamped_import(copier, mapped.epochs, ref, blocks, wait, copy) for _ in range(repeats + 1)]
            figures[f"again_{name}"] = medians(rows[1:])

        def after_prefill(pause_s: float = 0.0) -> str | None:
            session = prefill_session(stub, tokens, rng)
            time.sleep(pause_s)
            return session.session_id  # released once the round trip is timed

        def after_sleep() -> None:
            time.sleep(0.03)

        for name, before in (("after_prefill", after_prefill), ("5ms_after_prefill", lambda: after_prefill(0.005)),
                             ("after_30ms_asleep", after_sleep), ("idle", lambda: None)):
            trips = []
            for _ in range(repeats):
                session_id = before()
                trips.append(round_trip_us())
                if session_id is not None:
                    await release_quietly(channel, session_id)
            figures[f"round_trip_{name}_us"] = round(statistics.median(trips), 1)
        figures["kernel_mapped_us"] = kernel_us(copier, list(ref.block_ids), pinned=True)
        figures["kernel_mapped_ids_on_gpu_us"] = kernel_us(copier, list(ref.block_ids), pinned=False)
        figures["pull"] = await pull_backend(address, "cuda_ipc", tokens, repeats)  # the decode worker's own path
        own = torch.empty_like(mapped.tensor)
        epochs = BlockEpochs.create(own.shape[2])
        try:
            local = BlockCopier(own, blocks.cache)
            figures["kernel_local_us"] = kernel_us(local, list(ref.block_ids), pinned=True)
            for name, wait in (("wait_event", gather.wait_event), ("spin", spin)):
                rows = [await stamped_import(local, epochs, _with_epoch(ref, epochs), blocks, wait)
                        for _ in range(repeats + 1)]
                figures[f"local_{name}"] = medians(rows[1:])
        finally:
            epochs.close()
        transport.close()
        await channels.close()
    return figures


def _with_epoch(ref: common_pb2.KvSessionRef, epochs: BlockEpochs) -> common_pb2.KvSessionRef:
    out = common_pb2.KvSessionRef()
    out.CopyFrom(ref)
    out.attributes[EPOCH_ATTRIBUTE] = str(epochs.total(ref.block_ids))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-from", type=Path, required=True)
    parser.add_argument("--shape", default="llama-3.2-3b")
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "disagg-bench-models")
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    model = model_dir(args.shape, args.tokenizer_from, args.models)
    prefill = start_service("prefill", "--model", str(model), "--device", "cuda", "--dtype", "bfloat16",
                            "--num-kv-blocks", "2048", "--max-model-len", "4096", "--session-ttl", "120",
                            "--no-prefix-caching", timeout_s=600)
    try:
        figures = asyncio.run(trace(prefill.address, args.tokens, args.repeats))
    finally:
        prefill.stop()
    print(json.dumps({"figure": "kv_import_trace", "steps_us": STEPS, **figures}), flush=True)


if __name__ == "__main__":
    main()

"""The GPU KV data plane on one GPU: KV pull GB/s per backend next to the physical peers, then
`disagg bench` of prefill→decode (1P1D) against one aggregated worker on the same GPU and workload.

    python -m benchmarks.gpu_kv_plane --tokenizer-from DIR [--shape llama-3.2-3b] [--tokens 1500]

DIR holds a tokenizer (tokenizer.json, tokenizer_config.json, ...: SmolLM2's is enough); the model is
a random bf16 model of a real shape (benchmarks.gpu_engine_vs_hf.SHAPES). Part 1 starts a real prefill
worker and pulls sessions of `--tokens` tokens from this process through each backend (KvPuller, the
decode worker's own code: negotiation, the read, the release that proves the blocks were held), next
to a plain cross-process CUDA IPC copy of the same bytes, a device→pinned-host copy and HBM bandwidth.
Part 2 runs `disagg up` twice (--prefill 1 and --prefill 0) and `disagg bench` against each.
The cuda_ipc pull goes where a decode worker's goes: straight into blocks of a local cache (KvBlocks), fenced
by the exporter's block epochs, its Release sent in the background (so "pull" is the critical path: map
once, reserve, one copy kernel, the fence check); the other backends pull into a tensor and then release.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.block_manager import BlockManager  # noqa: E402
from common.engine.interface import KvBlocks  # noqa: E402
from common.kv import ipc_share  # noqa: E402
from common.kv.chunks import torch_dtype  # noqa: E402
from common.kv.layout import PlacedKv  # noqa: E402
from common.kv.layout import layout_of  # noqa: E402
from common.kv.pull import KvPuller  # noqa: E402
from common.kv.transports.cuda_ipc import direct  # noqa: E402
from common.kv.transports.cuda_ipc.block_copy import compile_for, copy_blocks  # noqa: E402
from common.kv.transports.nixl import nixl_unavailable_reason  # noqa: E402
from common.kv.wire import ChannelCache  # noqa: E402
from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402
from benchmarks.gpu_engine_vs_hf import emit, hbm_bandwidth, make_model  # noqa: E402
from services.cli.up import ONE_GPU_MAX_LOCAL_PREFILL_TOKENS  # noqa: E402
from benchmarks.processes import start_service  # noqa: E402

GB = 1e9
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
TARGETS = {"cuda_ipc_ms": 0.6, "grpc_gbps": 5.0, "throughput_ratio": 0.9, "ttft_ratio": 1.5}


def model_dir(shape: str, tokenizer_from: Path, root: Path, load_format: str = "auto") -> Path:
    """ROOT/<shape> holding the shape's random checkpoint (load_format dummy: its config.json alone) and
    tokenizer_from's tokenizer files; made once."""
    directory = root / (Path(shape).name + ("-dummy" if load_format == "dummy" else ""))
    if not (directory / "config.json").exists():
        make_model(shape, str(directory), load_format)
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, directory / name)
    return directory


def prefill_session(stub: worker_pb2_grpc.PrefillerStub, tokens: int, rng: random.Random) -> common_pb2.KvSessionRef:
    prompt = [rng.randrange(1000, 100_000) for _ in range(tokens)]
    response = stub.Prefill(worker_pb2.PrefillRequest(
        token_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0, max_tokens=2)), timeout=120)
    return response.session


def local_blocks(ref: common_pb2.KvSessionRef, num_blocks: int) -> KvBlocks:
    """A decode engine's cache and pool as the puller sees them (KvBlocks): cuda_ipc copies straight into it."""
    cache = torch.empty(layout_of(ref).block_shape(num_blocks), dtype=torch_dtype(ref.dtype), device="cuda")
    return BlockManager(num_blocks, ref.block_size).kv_blocks(cache)


async def pull_backend(address: str, backend: str, tokens: int, repeats: int) -> dict:
    device = torch.device("cuda")
    rng = random.Random(0)
    times, reads, used, size, puller = [], [], set(), 0, None
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.PrefillerStub(channel)
        for i in range(repeats + 1):  # the first pull maps / connects: reported apart
            ref = await asyncio.to_thread(prefill_session, stub, tokens, rng)
            if puller is None:
                puller = KvPuller(ChannelCache(), device, (backend,), blocks=local_blocks(ref, 2 * len(ref.block_ids)),
                                  self_check=False)
                compile_for(puller.blocks.cache)  # as a decode worker does as it starts
            pulled = await puller.pull_and_release(ref, timeout_s=60)
            if isinstance(pulled.export, PlacedKv):
                pulled.export.discard()  # (an engine would adopt them)
            used.add(pulled.transport)
            size = pulled.num_bytes
            if i == 0:
                first = pulled.seconds
            else:
                times.append(pulled.seconds)
                reads.append(pulled.read_seconds)
    apart = await _pull_apart(puller, ref, repeats) if backend == "cuda_ipc" else {}
    await puller.close()
    median, read = statistics.median(times), statistics.median(reads)
    read_figures = {"read_ms": round(read * 1e3, 3), "read_gbps": round(size / read / GB, 1)} if read else {}
    return emit("kv_pull", backend=backend, used=sorted(used), tokens=tokens, bytes=size,
                median_ms=round(median * 1e3, 3), first_ms=round(first * 1e3, 3), gbps=round(size / median / GB, 2),
                **read_figures, **apart)


async def _pull_apart(puller: KvPuller, ref: common_pb2.KvSessionRef, repeats: int) -> dict:
    """The last session pulled again and again with no prefill in between (its Release answers false by now, which
    a fenced read ignores; nothing reuses its blocks meanwhile), and cuda_ipc's direct.import_placed alone on the
    same mapping: what the puller adds, and what a pull right after the exporter's prefill costs beyond that."""
    again, alone = [], []
    mapped = await puller.transports["cuda_ipc"].map_cache(puller.channels.get(ref.endpoint), ref)
    for _ in range(repeats):
        pulled = await puller.pull_and_release(ref, timeout_s=60)
        pulled.export.discard()
        again.append(pulled.seconds)
        start = time.perf_counter()
        placed = await direct.import_placed(mapped.copier, mapped.epochs, ref, layout_of(ref), puller.blocks,
                                            lambda: None)
        alone.append(time.perf_counter() - start)
        placed.discard()
    return {"pull_again_ms": round(statistics.median(again) * 1e3, 3),
            "import_placed_ms": round(statistics.median(alone) * 1e3, 3)}


def _time_copy(dst: torch.Tensor, src: torch.Tensor, repeats: int = 20) -> float:
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def peer_copies(address: str, num_bytes: int) -> dict:
    """A contiguous copy of the pull's bytes out of the prefill worker's cache mapped through CUDA IPC,
    and a device→pinned-host copy of the same bytes: what the two kinds of backend could reach."""
    with grpc.insecure_channel(address) as channel:
        share = worker_pb2_grpc.TensorStoreStub(channel).OpenKvCache(
            worker_pb2.OpenKvCacheRequest(transport="cuda_ipc"), timeout=30)
    cache = ipc_share.open_cache(share)
    mapped = cache.view(-1).view(torch.uint8)[:num_bytes]
    local = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    ipc_s, host_s = _time_copy(local, mapped), _time_copy(pinned, local)
    kernel_ms = _time_block_copy(cache, num_bytes // (cache[:, :, 0].numel() * cache.element_size()))
    return emit("peer_copies", bytes=num_bytes, cuda_ipc_copy_gbps=round(num_bytes / ipc_s / GB, 1),
                pinned_d2h_gbps=round(num_bytes / host_s / GB, 1), block_copy_kernel_ms=round(kernel_ms, 3),
                block_copy_kernel_gbps=round(num_bytes / kernel_ms / 1e6, 1))


def _time_block_copy(cache: torch.Tensor, num_blocks: int, repeats: int = 20) -> float:
    """GPU time (ms, median) of the import's copy (cuda_ipc's block_copy) of `num_blocks` blocks of the mapped
    cache into a local cache, as a pull issues it: ids built on the host, one kernel."""
    local = torch.empty((*cache.shape[:2], 2 * num_blocks, *cache.shape[3:]), dtype=cache.dtype, device="cuda")
    src, dst = list(range(100, 100 + num_blocks)), list(range(num_blocks, 2 * num_blocks))
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy_blocks(cache, src, local, dst)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def kv_pulls(model: Path, tokens: int, repeats: int) -> dict:
    engine = ("--model", str(model), "--device", "cuda", "--dtype", "bfloat16", "--num-kv-blocks", "2048",
              "--max-model-len", "4096", "--session-ttl", "120")
    prefill = start_service("prefill", *engine, timeout_s=600)
    try:
        backends = ["cuda_ipc", *(["nixl"] if nixl_unavailable_reason() is None else []), "shm", "grpc"]
        results = {b: asyncio.run(pull_backend(prefill.address, b, tokens, repeats)) for b in backends}
        peers = peer_copies(prefill.address, results["cuda_ipc"]["bytes"])
    finally:
        prefill.stop()
    return {"pulls": results, "peers": peers}


def serve_and_bench(model: Path, prefill_workers: int, args: argparse.Namespace, out: Path,
                    router_flags: list[str] | None = None) -> dict:
    port = 50177 + prefill_workers + (2 if router_flags else 0)
    # One GPU shared by both workers (the bench measures the one-GPU handoff), whatever the host has.
    up = [sys.executable, "-m", "services", "up", "--model", str(model), "--gpus", "0", "--share-gpus", "--dtype",
          "bfloat16",
          "--num-kv-blocks", "4096", "--max-model-len", "4096", "--router-port", str(port),
          "--prefill", str(prefill_workers), "--decode", "1", *(router_flags or ["--max-local-prefill-tokens", "0"])]
    name = f"{prefill_workers}p{'_cond' if router_flags else ''}"
    log = open(out / f"up_{name}.log", "w")
    cluster = subprocess.Popen(up, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while "disagg is up" not in (out / f"up_{name}.log").read_text():
            if cluster.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"disagg up failed:\n{(out / f'up_{name}.log').read_text()[-3000:]}")
            time.sleep(1)
        result = out / f"bench_{name}.json"
        subprocess.run([sys.executable, "-m", "services", "bench", "--router", f"127.0.0.1:{port}",
                        "--num-prompts", str(args.num_prompts), "--input-len", args.input_len,
                        "--output-len", args.output_len, "--max-concurrency", str(args.concurrency),
                        "--json", str(result)], check=True, timeout=900)
        summary = json.loads(result.read_text())["summary"]
    finally:
        cluster.terminate()
        cluster.wait(timeout=60)
        log.close()
    mode = ("1P1D" + (" " + " ".join(router_flags) if router_flags else "")) if prefill_workers else "aggregated"
    return emit("serving", mode=mode, completed=summary["completed"], failed=summary["failed"],
                output_tok_s=round(summary["output_throughput"], 1),
                ttft_mean_ms=round(summary["ttft"]["mean"], 1), ttft_p99_ms=round(summary["ttft"]["p99"], 1),
                tpot_mean_ms=round(summary["tpot"]["mean"], 2), itl_p99_ms=round(summary["itl"]["p99"], 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-from", type=Path, required=True)
    parser.add_argument("--shape", default="llama-3.2-3b")
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "disagg-bench-models")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="uniform:512:2048")
    parser.add_argument("--output-len", default="fixed:128")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-local-prefill-tokens", type=int, default=ONE_GPU_MAX_LOCAL_PREFILL_TOKENS,
                        help="a third run: 1P1D with conditional disaggregation (0 skips it)")
    parser.add_argument("--skip-pulls", action="store_true")
    parser.add_argument("--skip-serving", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = model_dir(args.shape, args.tokenizer_from, args.models)
    emit("hbm", gbps=round(hbm_bandwidth() / GB, 1), device=torch.cuda.get_device_name())
    if not args.skip_pulls:
        figures = kv_pulls(model, args.tokens, args.repeats)
        emit("targets", cuda_ipc_ms=figures["pulls"]["cuda_ipc"]["median_ms"], cuda_ipc_target_ms=TARGETS["cuda_ipc_ms"],
             grpc_gbps=figures["pulls"]["grpc"]["gbps"], grpc_target=TARGETS["grpc_gbps"])
    if not args.skip_serving:
        torch.cuda.empty_cache()
        aggregated = serve_and_bench(model, 0, args, args.out)
        runs = {"1P1D": serve_and_bench(model, 1, args, args.out)}
        if args.max_local_prefill_tokens:
            runs["1P1D conditional"] = serve_and_bench(model, 1, args, args.out,
                                                       ["--max-local-prefill-tokens", str(args.max_local_prefill_tokens)])
        for mode, disagg in runs.items():
            emit("serving_ratio", mode=mode, throughput=round(disagg["output_tok_s"] / aggregated["output_tok_s"], 3),
                 throughput_target=TARGETS["throughput_ratio"],
                 ttft=round(disagg["ttft_mean_ms"] / aggregated["ttft_mean_ms"], 3), ttft_target=TARGETS["ttft_ratio"])


if __name__ == "__main__":
    main()

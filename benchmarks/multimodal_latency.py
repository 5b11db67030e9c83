"""Image requests through router → encode → prefill → decode vs HF generate on the same image and prompt.

    python -m benchmarks.multimodal_latency [--requests 8] [--output-tokens 32] [--image-size 336]

SmolLM2-135M as the text model under a small random CLIP tower (benchmarks/tiny_llava.py), float32,
greedy, ignore_eos, one request at a time. Each request has a new image (no prefix-cache hit),
then the same requests are sent again (their image blocks come from the prefix cache). TTFT and
end-to-end latency are measured at the client; HF is `generate` in this process with the
processor's preprocessing included. Tokens are checked equal to HF's for the first request.
"""
from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import torch
from PIL import Image

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from benchmarks.processes import start_services
from benchmarks.tiny_llava import _hf, make_smollm2_llava

PROMPT = "<image>\nDescribe this picture in detail."


def _png(seed: int, size: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype(np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def _serve_once(stub, image: bytes, max_tokens: int) -> tuple[float, float, list[int]]:
    request = generation_pb2.GenerateRequest(
        prompt=PROMPT, images=[common_pb2.Image(data=image)],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
        stop=common_pb2.StopConditions(ignore_eos=True))
    start, ttft, tokens = time.perf_counter(), None, []
    for response in stub.Generate(request):
        if response.HasField("delta") and response.delta.token_ids:
            ttft = ttft or time.perf_counter() - start
            tokens += response.delta.token_ids
    return ttft, time.perf_counter() - start, tokens


@torch.inference_mode()
def _hf_once(model_dir: str, image: bytes, max_tokens: int) -> tuple[float, list[int]]:
    model, processor = _hf(model_dir)
    start = time.perf_counter()
    inputs = processor(images=Image.open(io.BytesIO(image)).convert("RGB"), text=PROMPT, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return time.perf_counter() - start, out[0, inputs["input_ids"].shape[1]:].tolist()


def _ms(values: list[float]) -> str:
    return f"mean {statistics.mean(values) * 1000:.1f} ms, median {statistics.median(values) * 1000:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=336, help="side of the (random) PNG sent")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_smollm2_llava(Path(tmp) / "smollm2-llava"))
        env = {"OMP_NUM_THREADS": "1"}
        workers = start_services([(role, ("--model", model)) for role in ("encode", "prefill", "decode")], env=env)
        processes = list(workers)
        try:
            encode, prefill, decode = workers
            processes += start_services([("router", ("--model", model, "--encode-workers", encode.address,
                                                     "--prefill-workers", prefill.address,
                                                     "--decode-workers", decode.address))], env=env)
            stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(processes[-1].address))
            images = [_png(seed, args.image_size) for seed in range(args.requests)]
            _serve_once(stub, _png(999, args.image_size), 2)  # warm-up
            cold = [_serve_once(stub, image, args.output_tokens) for image in images]
            warm = [_serve_once(stub, image, args.output_tokens) for image in images]
            hf = [_hf_once(model, image, args.output_tokens) for image in images[:3]]
            assert cold[0][2] == hf[0][1] == warm[0][2], "service tokens differ from HF generate"
        finally:
            for process in processes:
                process.stop()
    tokens = args.output_tokens
    print(f"{args.requests} requests, {args.image_size}px PNG, {tokens} output tokens, SmolLM2-135M + random CLIP")
    print(f"service, new image     : TTFT {_ms([c[0] for c in cold])}; e2e {_ms([c[1] for c in cold])}; "
          f"{tokens / statistics.mean(c[1] for c in cold):.1f} tok/s")
    print(f"service, cached prefix : TTFT {_ms([w[0] for w in warm])}; e2e {_ms([w[1] for w in warm])}")
    print(f"HF generate (in process): e2e {_ms([h[0] for h in hf])}; {tokens / statistics.mean(h[0] for h in hf):.1f} tok/s")


if __name__ == "__main__":
    main()

"""A normal request's TTFT alone, then while a 15 MB prompt is being refused (issue #23: within 2x).

    disagg up &   # router on 127.0.0.1:50051
    python -m benchmarks.oversized_prompt 127.0.0.1:50051
"""
import sys
import threading
import time

import grpc

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc

OPTIONS = [("grpc.max_send_message_length", 32 << 20), ("grpc.max_receive_message_length", 32 << 20)]


def ttft(stub) -> float:
    request = generation_pb2.GenerateRequest(prompt="The capital of France is",
                                             sampling=common_pb2.SamplingParams(temperature=0, max_tokens=2))
    start = time.perf_counter()
    for response in stub.Generate(request, timeout=60):
        if response.HasField("delta"):
            return time.perf_counter() - start
    raise AssertionError("no token")


def big(stub, out):
    try:
        list(stub.Generate(generation_pb2.GenerateRequest(prompt="word " * 3_000_000), timeout=60))
    except grpc.RpcError as exc:
        out.append((exc.code().name, exc.details()[:90], time.perf_counter()))


def main(router: str) -> None:
    with grpc.insecure_channel(router, options=OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for _ in range(3):
            ttft(stub)
        alone = sorted(ttft(stub) for _ in range(7))[3]
        loaded = []
        for _ in range(5):
            out = []
            thread = threading.Thread(target=big, args=(stub, out))
            thread.start()
            time.sleep(0.02)  # the 15 MB request is on its way / being refused
            loaded.append(ttft(stub))
            thread.join()
    print(f"normal request TTFT alone (median of 7): {alone*1000:.1f} ms; while a 15 MB prompt is refused: "
          f"median {sorted(loaded)[2]*1000:.1f} ms, max {max(loaded)*1000:.1f} ms ({max(loaded)/alone:.2f}x); "
          f"the big one: {out[0][0]}: {out[0][1]}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051")

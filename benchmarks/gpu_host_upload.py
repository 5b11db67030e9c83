"""Host time of one prompt step's metadata upload: each array pinned and copied alone (`Tensor.pin_memory()`, the
engine's way before common.engine.host_upload) against one packed buffer and one copy (`upload`).

    python -m benchmarks.gpu_host_upload

The arrays are a 1280-token prefill's (slots, block table, per-sequence and per-tile metadata, positions).
Prints µs of host a step for each way, twice, alternating (the GPU copies run behind; only the host is timed).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from common.engine.host_upload import upload

ARRAYS = [np.arange(1280, dtype=np.int64), np.zeros((1, 80), np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32),
          np.zeros(1, np.int32), np.zeros(20, np.int32), np.zeros(20, np.int32), np.arange(1280, dtype=np.int64),
          np.zeros(1, np.int64)]


def one_by_one(device: torch.device) -> list[torch.Tensor]:
    return [torch.from_numpy(a).pin_memory().to(device, non_blocking=True) for a in ARRAYS]


def packed(device: torch.device) -> list[torch.Tensor]:
    return upload(ARRAYS, device)


def host_us(fn, device: torch.device, calls: int = 500) -> float:
    for _ in range(50):
        fn(device)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn(device)
    elapsed = (time.perf_counter() - start) / calls
    torch.cuda.synchronize(device)
    return elapsed * 1e6


def main() -> None:
    device = torch.device("cuda")
    for fn in (one_by_one, packed, one_by_one, packed):
        print(f"{fn.__name__}: {host_us(fn, device):.1f} µs a step ({len(ARRAYS)} arrays)", flush=True)


if __name__ == "__main__":
    main()

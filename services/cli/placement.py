"""Where `disagg up` puts its workers: GPUs handed out in order, prefill workers first, then decode workers, each
worker taking `tp` consecutive GPUs (a worker's tensor-parallel rank r runs on its first GPU + r). Pure: the GPUs
are passed in, so it is tested without one.

    place({"prefill": 1, "decode": 3}, {"prefill": 1, "decode": 1}, gpus=(0, 1, 2, 3))
    # prefill-0 on cuda:0, decode-0..2 on cuda:1..3

More ranks than GPUs is a PlacementError (one line) unless `share` is on: then the workers go round-robin over the
GPUs, several on one, and each one's --gpu-memory-utilization is the user's divided by the workers on its GPU.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from common.errors import InvalidConfig

ROLES = ("prefill", "decode")


class PlacementError(InvalidConfig):
    """The workers do not fit the GPUs as asked; the message names the counts and the way out."""


@dataclass(frozen=True)
class WorkerPlacement:
    name: str  # prefill-0, decode-2, ...
    role: str  # prefill | decode
    devices: tuple[int, ...] = ()  # its GPUs, rank order; () off CUDA
    workers_on_gpu: int = 1  # workers on the busiest of its GPUs (1: it has them to itself)

    @property
    def device(self) -> str | None:
        """Its --device: the first GPU (the TP base device); None off CUDA (the user's --device stands)."""
        return f"cuda:{self.devices[0]}" if self.devices else None

    def gpus_text(self) -> str:
        """`cuda:0`, or `cuda:0,1 (TP 2)`, for the summary."""
        if not self.devices:
            return ""
        tp = f" (TP {len(self.devices)})" if len(self.devices) > 1 else ""
        return "cuda:" + ",".join(map(str, self.devices)) + tp


def parse_gpus(text: str) -> tuple[int, ...]:
    """--gpus 0,1,2,3: distinct CUDA indices, in the order workers take them."""
    try:
        gpus = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--gpus takes comma-separated GPU indices such as 0,1,2,3, got {text!r}") from None
    if not gpus or min(gpus) < 0 or len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus takes distinct GPU indices >= 0, got {text!r}")
    return gpus


def check_gpus(gpus: Sequence[int], visible: int) -> None:
    """PlacementError unless every GPU of --gpus is one this process sees (CUDA_VISIBLE_DEVICES applies)."""
    if not visible:
        raise PlacementError("--device cuda, but no CUDA GPU is visible to this process (torch.cuda.device_count() "
                             "is 0); use --device cpu")
    missing = [g for g in gpus if g >= visible]
    if missing:
        raise PlacementError(f"--gpus names cuda:{','.join(map(str, missing))}, but this process sees {visible} "
                             f"GPU{'s' if visible > 1 else ''} (cuda:0..{visible - 1}; CUDA_VISIBLE_DEVICES applies)")


def default_counts(num_gpus: int, tp: Mapping[str, int]) -> dict[str, int]:
    """The layout a CUDA host gets when the user names no counts: half its GPUs prefill (at least one worker), the
    rest decode (at least one: on one GPU the two share it). With prompts longer than the outputs, one prefill GPU
    caps the request rate well before three decode GPUs fill, so the split is even; outputs much longer than the
    prompts want more decode workers (--prefill 1 --decode 3)."""
    prefill = max(1, num_gpus // 2 // tp["prefill"])
    return {"prefill": prefill, "decode": max(1, (num_gpus - prefill * tp["prefill"]) // tp["decode"])}


def place(counts: Mapping[str, int], tp: Mapping[str, int], gpus: Sequence[int] | None,
          share: bool = False) -> list[WorkerPlacement]:
    """Every worker's GPUs: in order, prefill first, each taking tp[role] consecutive GPUs of `gpus`; with `share`,
    round-robin from the first GPU again once they run out. `gpus` None: off CUDA, no devices."""
    names = [(f"{role}-{i}", role) for role in ROLES for i in range(counts[role])]
    if gpus is None:
        return [WorkerPlacement(name, role) for name, role in names]
    _check_fits(counts, tp, gpus, share)
    cursor, laid = 0, []
    for name, role in names:
        size = tp[role]
        if cursor + size > len(gpus):
            cursor = 0
        devices = tuple(gpus[cursor:cursor + size])
        if devices != tuple(range(devices[0], devices[0] + size)):
            raise PlacementError(f"{name}'s {size} tensor-parallel ranks run on consecutive GPUs (cuda:K..K+{size - 1})"
                                 f", but --gpus gives it cuda:{','.join(map(str, devices))}; list consecutive GPUs")
        laid.append((name, role, devices))
        cursor = (cursor + size) % len(gpus)
    load = collections.Counter(d for _, _, devices in laid for d in devices)
    return [WorkerPlacement(name, role, devices, max(load[d] for d in devices)) for name, role, devices in laid]


def _check_fits(counts: Mapping[str, int], tp: Mapping[str, int], gpus: Sequence[int], share: bool) -> None:
    have = f"--gpus gives {len(gpus)} ({','.join(map(str, gpus))})"
    for role in ROLES:
        if counts[role] and tp[role] > len(gpus):
            raise PlacementError(f"a {role} worker of tensor-parallel size {tp[role]} needs {tp[role]} GPUs, one a "
                                 f"rank; {have}")
    ranks = sum(counts[role] * tp[role] for role in ROLES)
    if ranks > len(gpus) and not share:
        workers = " and ".join(f"{counts[r]} {r} worker{'s' if counts[r] != 1 else ''}"
                               + (f" of TP {tp[r]}" if tp[r] > 1 else "") for r in ROLES if counts[r])
        raise PlacementError(f"{workers} need {ranks} GPUs, one a rank; {have}. Add --share-gpus to put several "
                             "workers on a GPU (each gets its share of --gpu-memory-utilization), or ask for fewer")


def memory_share(utilization: float | None, worker: WorkerPlacement) -> float | None:
    """A worker's --gpu-memory-utilization: the user's, divided by the workers on its busiest GPU (rounded down, so
    the shares never add up to more than the user's)."""
    if utilization is None or worker.workers_on_gpu == 1:
        return utilization
    return math.floor(utilization / worker.workers_on_gpu * 10_000) / 10_000


def shares_gpus(workers: Sequence[WorkerPlacement]) -> bool:
    """Whether some GPU holds more than one worker."""
    return any(w.workers_on_gpu > 1 for w in workers)

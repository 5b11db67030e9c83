"""Every layout of the devices at hand that `disagg up` can start, and a layout as up's flags.

On CUDA the devices are GPUs: for each TP size a worker takes that many, and the workers split into every xPyD
(x prefill, y decode workers; x = 0 is y aggregated workers). On the CPU they are cores, laid out as up lays them
out (services/cli/cpu_layout.py): 1..N workers, each worker's model on its share of the cores. Each layout with a
prefill worker also comes with local-prefill thresholds (the router's --max-local-prefill-tokens: prompts this
short prefill on their decode worker), taken from the workload's prompt lengths.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from common.errors import InvalidConfig
from services.cli.cpu_layout import cpu_layout
from services.planner.workload import Workload


@dataclass(frozen=True)
class Devices:
    kind: str  # "cuda" | "cpu"
    ids: tuple[int, ...]  # GPU indices, or CPU cores
    name: str = ""  # the GPU's or the CPU's model name

    def describe(self) -> str:
        what = "GPU" if self.kind == "cuda" else "core"
        return f"{self.kind}: {len(self.ids)} {what}{'s' if len(self.ids) != 1 else ''}" + (
            f" ({self.name})" if self.name else "")


@dataclass(frozen=True)
class Layout:
    prefill: int
    decode: int
    units: tuple[str, ...]  # each worker's profile unit, prefill workers first ("gpus=1", "cores=2", ...)
    max_local_prefill_tokens: int = 0
    tensor_parallel_size: int = 1

    def describe(self) -> str:
        if not self.prefill:
            base = f"{self.decode} x aggregated"
        else:
            base = f"{self.prefill}P{self.decode}D"
            if self.max_local_prefill_tokens:
                base += f" local<={self.max_local_prefill_tokens}"
        return base + (f" TP{self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else "")

    def up_flags(self) -> list[str]:
        """The `disagg up` flags that start it."""
        flags = ["--prefill", str(self.prefill), "--decode", str(self.decode)]
        if self.prefill:
            flags += ["--max-local-prefill-tokens", str(self.max_local_prefill_tokens)]
        if self.tensor_parallel_size > 1:
            flags += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        return flags


def thresholds(workload: Workload, samples: int = 2000) -> list[int]:
    """0 (every prompt remote) and the prompt lengths' quartiles, rounded to 64 tokens, where they split the
    workload (a threshold below every prompt or above every one is one of the plain layouts)."""
    rng = random.Random(0)
    lengths = sorted(workload.prompt.sample(rng) for _ in range(samples))
    found = {0}
    for q in (0.25, 0.5, 0.75):
        cut = int(round(lengths[int(q * (len(lengths) - 1))] / 64) * 64)
        if lengths[0] <= cut < lengths[-1]:
            found.add(cut)
    return sorted(found)


def cuda_layouts(gpus: int, tp_sizes: Sequence[int], cuts: Sequence[int]) -> list[Layout]:
    out = []
    for tp in tp_sizes:
        slots = gpus // tp
        for prefill in range(slots):
            for cut in (cuts if prefill else [0]):
                out.append(Layout(prefill, slots - prefill, (f"gpus={tp}",) * slots, cut, tp))
    return out


def cpu_layouts(cores: tuple[int, ...], cuts: Sequence[int]) -> list[Layout]:
    out = []
    for workers in range(1, len(cores) + 1):
        for prefill in range(workers):
            names = [f"prefill-{i}" for i in range(prefill)] + [f"decode-{i}" for i in range(workers - prefill)]
            placed = cpu_layout(cores, names).model_cores
            units = tuple(f"cores={len(placed[n])}" for n in names)
            for cut in (cuts if prefill else [0]):
                out.append(Layout(prefill, workers - prefill, units, cut))
    return out


def layouts(devices: Devices, workload: Workload, tp_sizes: Sequence[int] = (1,)) -> list[Layout]:
    cuts = thresholds(workload)
    if devices.kind == "cuda":
        return cuda_layouts(len(devices.ids), tp_sizes, cuts)
    return cpu_layouts(devices.ids, cuts)


def units_needed(candidates: Sequence[Layout]) -> list[str]:
    return sorted({u for layout in candidates for u in layout.units})


def save_plan(path: Path, layout: Layout, summary: dict) -> None:
    """The plan file `disagg up --plan FILE` starts: the layout, its up flags and what was predicted of it."""
    path.write_text(json.dumps({"layout": asdict(layout), "up_flags": layout.up_flags(), **summary}, indent=1,
                               default=str) + "\n")


def load_plan(path: str) -> Layout:
    try:
        raw = json.loads(Path(path).read_text())["layout"]
        layout = Layout(**{**raw, "units": tuple(raw["units"])})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidConfig(f"--plan {path}: not a plan `disagg plan --save` wrote ({exc})") from None
    if layout.decode < 1 or layout.prefill < 0 or layout.max_local_prefill_tokens < 0:
        raise InvalidConfig(f"--plan {path}: a layout needs a decode worker, got {layout.describe()}")
    return layout

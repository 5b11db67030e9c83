"""The crossover, table and plot of benchmarks/disagg_sweep.py's runs (plain dicts, as in its sweep.json).

    python -m benchmarks.disagg_sweep_plot OUT/sweep.json   # redraw OUT/sweep.png and reprint the table
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

PANELS = (("output_tok_s", "output tok/s"), ("ttft_mean_ms", "TTFT mean (ms)"), ("itl_p99_ms", "ITL p99 (ms)"))
STYLES = {"aggregated": ("tab:gray", "o"), "remote": ("tab:red", "s"), "conditional": ("tab:blue", "^")}


def _runs(results: list[dict], mode: str, output: int) -> dict[int, dict]:
    return {int(r["input"]): r for r in results if r["mode"] == mode and r["output"] == output and r["input"].isdigit()}


# When every prefill remote "pays" in a cell: issue #24's targets for it, against aggregated on the same GPU.
PAYS = {"throughput": 0.9, "ttft": 1.5, "itl_gain": 2.0}


def pays(agg: dict, remote: dict) -> bool:
    return (remote["output_tok_s"] >= PAYS["throughput"] * agg["output_tok_s"]
            and remote["ttft_mean_ms"] <= PAYS["ttft"] * agg["ttft_mean_ms"]
            and agg["itl_p99_ms"] >= PAYS["itl_gain"] * remote["itl_p99_ms"])


def crossover_of(points: list[tuple[int, float, bool]]) -> float:
    """The input length from which remote pays at every longer length, from (input, ITL p99 gain, pays) per
    cell: log-linear in the gain between the last cell that does not pay and the next, 0 when remote pays at
    every length, inf when it does not pay at the longest."""
    points = sorted(points)
    if all(ok for _, _, ok in points):
        return 0.0
    last = max(i for i, (_, _, ok) in enumerate(points) if not ok)
    if last == len(points) - 1:
        return math.inf
    (x0, g0, _), (x1, g1, _) = points[last], points[last + 1]
    t = min(max((PAYS["itl_gain"] - g0) / (g1 - g0), 0.0), 1.0) if g1 != g0 else 1.0
    return 2 ** (math.log2(x0) + t * (math.log2(x1) - math.log2(x0)))


def crossover(results: list[dict], inputs: list[str]) -> int:
    """The conditional rule's threshold (prompts up to it prefill locally): the shortest crossover over the output
    lengths at which remote pays at all (the rule sees the prompt, not the output), rounded up to a multiple of 64;
    the longest input tested when remote pays at none."""
    found = []
    for output in sorted({r["output"] for r in results}):
        agg, remote = _runs(results, "aggregated", output), _runs(results, "remote", output)
        points = [(x, agg[x]["itl_p99_ms"] / remote[x]["itl_p99_ms"], pays(agg[x], remote[x]))
                  for x in sorted(agg) if x in remote]
        if points:
            found.append(crossover_of(points))
    finite = [x for x in found if not math.isinf(x)]
    if not finite:
        return max((int(s) for s in inputs if s.isdigit()), default=0)
    return int(math.ceil(min(finite) / 64) * 64)


def table(results: list[dict]) -> str:
    lines = ["| input | output | mode | output tok/s (× aggregated) | TTFT mean / p90 (ms) | ITL p99 (ms) | "
             "KV pull mean (ms, pulls) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    base = {(r["input"], r["output"]): r for r in results if r["mode"] == "aggregated"}
    for r in sorted(results, key=lambda r: (r["output"], _order(r["input"]), list(STYLES).index(r["mode"]))):
        agg = base.get((r["input"], r["output"]))
        ratio = f" ({r['output_tok_s'] / agg['output_tok_s']:.2f}×)" if agg and r["mode"] != "aggregated" else ""
        pull = f"{r['kv_pull_mean_ms']:.2f} ({r['kv_pulls']})" if r.get("kv_pull_mean_ms") is not None else "—"
        mode = r["mode"] + (f" (≤ {r['threshold']} local)" if r.get("threshold") is not None else "")
        lines.append(f"| {r['input']} | {r['output']} | {mode} | {r['output_tok_s']:.0f}{ratio} | "
                     f"{r['ttft_mean_ms']:.1f} / {r['ttft_p90_ms']:.1f} | {r['itl_p99_ms']:.1f} | {pull} |")
    return "\n".join(lines) + "\n"


def _order(spec: str) -> float:
    return float(spec) if spec.isdigit() else math.inf


def plot(results: list[dict], threshold: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outputs = sorted({r["output"] for r in results})
    fig, axes = plt.subplots(len(outputs), len(PANELS), figsize=(4.2 * len(PANELS), 3.2 * len(outputs)), squeeze=False)
    for row, output in enumerate(outputs):
        for col, (key, label) in enumerate(PANELS):
            ax = axes[row][col]
            for mode, (color, marker) in STYLES.items():
                runs = _runs([r for r in results if r.get("threshold") in (None, threshold)], mode, output)
                if runs:
                    xs = sorted(runs)
                    ax.plot(xs, [runs[x][key] for x in xs], color=color, marker=marker, label=mode)
            if threshold:
                ax.axvline(threshold, color="tab:blue", linestyle=":", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("input tokens")
            ax.set_title(f"{label}, output {output}", fontsize=10)
            if key == "ttft_mean_ms":
                ax.set_yscale("log")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{title}; dotted: the conditional rule's threshold, {threshold} prompt tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    path = Path(sys.argv[1])
    data = json.loads(path.read_text())
    results = data["runs"]
    threshold = next((r["threshold"] for r in results if r.get("threshold") is not None), 0)
    config = data.get("config", {})
    plot(results, threshold, path.with_suffix(".png"),
         f"{config.get('shape', '')}, bf16, one GPU, concurrency {config.get('concurrency', '')}")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The summary as a terminal table, a JSON file and a PNG of the latency distributions."""
from __future__ import annotations

import json
from pathlib import Path

from services.cli.bench.stats import (AFTER_FIRST_TOKEN_PARTS, CLIENT_LOOP_SATURATED, FIRST_TOKEN_PARTS, Distribution,
                                      RequestRecord, Summary)

_PART_NAMES = {"router_queue_ms": "router queue", "prefill_queue_ms": "prefill queue",
               "prefill_compute_ms": "prefill compute", "other_ms": "other (network, gRPC)",
               "router_worker_ms": "  of it router <-> worker", "client_router_ms": "  of it client <-> router",
               "kv_handoff_ms": "KV handoff", "first_decode_step_ms": "first decode step"}


def format_table(summary: Summary, title: str) -> str:
    s = summary
    lines = [f"{'=' * 20} {title} {'=' * 20}",
             f"{'Successful requests:':<40}{s.completed:>12}",
             f"{'Failed requests:':<40}{s.failed:>12}",
             f"{'Benchmark duration (s):':<40}{s.duration_s:>12.2f}",
             f"{'Total input tokens:':<40}{s.input_tokens:>12}",
             f"{'Total generated tokens:':<40}{s.output_tokens:>12}",
             f"{'Request throughput (req/s):':<40}{s.request_throughput:>12.2f}",
             f"{'Output token throughput (tok/s):':<40}{s.output_throughput:>12.2f}",
             f"{'Total token throughput (tok/s):':<40}{s.total_token_throughput:>12.2f}"]
    if s.goodput is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{s.goodput:>12.2f}")
    for name, dist in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E latency", s.e2e)):
        lines.append(f"{('-' * 8) + ' ' + name + ' (ms) ' + ('-' * 8):-<52}")
        for stat in ("mean", "p50", "p90", "p99"):
            lines.append(f"{stat.upper() if stat != 'mean' else 'Mean':<40}{getattr(dist, stat):>12.2f}")
    if s.client_loop_busy:
        busiest = max(s.client_loop_busy)
        several = len(s.client_loop_busy) > 1
        label = f"Client loop busy (cores{f', max of {len(s.client_loop_busy)}' if several else ''}):"
        lines.append(f"{label:<40}{busiest:>12.3f}")  # (a light load reads 0.00x: shown, not hidden)
        if busiest >= CLIENT_LOOP_SATURATED:
            lines.append(f"note: a client's event loop kept {busiest:.2f} of a core busy: it delayed what it timed; "
                         "send from more processes (--clients N)")
    for error in s.errors:
        lines.append(f"error: {error}")
    lines.append("=" * 52)
    return "\n".join(lines)


def format_breakdown(summary: Summary, api: str) -> str:
    """Where the TTFT went, part by part (stats.py's module doc defines them), or why there is no breakdown."""
    if summary.ttft_breakdown is None:
        return (f"TTFT breakdown: none through {api}: it comes from the router's usage (disagg.v1 Finished.usage, "
                "or the OpenAI usage chunk), which KServe v2 does not carry" if api == "kserve" else
                f"TTFT breakdown: none; no completed request through {api} reported one")
    lines = [f"{'-' * 8} TTFT breakdown (ms, the router's parts) {'-' * 8}",
             f"{'part':<28}{'n':>6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]

    def row(part: str) -> str:
        d: Distribution = summary.ttft_breakdown[part]
        return f"{_PART_NAMES[part]:<28}{d.count:>6}{d.mean:>10.2f}{d.p50:>10.2f}{d.p90:>10.2f}{d.p99:>10.2f}"

    lines += [row(part) for part in (*FIRST_TOKEN_PARTS, "other_ms", "router_worker_ms", "client_router_ms")
              if part in summary.ttft_breakdown]
    lines.append(f"{'TTFT (client)':<28}{summary.ttft.count:>6}{summary.ttft.mean:>10.2f}{summary.ttft.p50:>10.2f}"
                 f"{summary.ttft.p90:>10.2f}{summary.ttft.p99:>10.2f}")
    lines.append("after the first token (prefill -> decode; the second token waits for these):")
    lines += [row(part) for part in AFTER_FIRST_TOKEN_PARTS]
    return "\n".join(lines)


def format_comparison(summaries: dict[str, Summary]) -> str:
    """One row per front door, each next to the first (native gRPC when listed first)."""
    base_name, base = next(iter(summaries.items()))
    lines = [f"{'=' * 16} Front doors, same workload {'=' * 16}",
             f"{'api':<8}{'TTFT p50':>10}{'TTFT mean':>11}{'TTFT p99':>10}{'out tok/s':>11}{'Δ TTFT p50':>12}"
             f"{'tok/s ratio':>12}"]
    for name, s in summaries.items():
        delta = s.ttft.p50 - base.ttft.p50
        ratio = s.output_throughput / base.output_throughput if base.output_throughput else float("nan")
        lines.append(f"{name:<8}{s.ttft.p50:>10.2f}{s.ttft.mean:>11.2f}{s.ttft.p99:>10.2f}{s.output_throughput:>11.2f}"
                     f"{delta:>+10.2f}ms{ratio:>11.3f}x")
    lines.append(f"(TTFT in ms; Δ and ratio against {base_name})")
    return "\n".join(lines)


def write_json(path: Path, config: dict, summary: Summary, records: list[RequestRecord]) -> None:
    first = min((r.start for r in records if r.start), default=0.0)  # `sent_s`: each send after the first
    per_request = [{"prompt_tokens": r.prompt_tokens, "max_tokens": r.max_tokens, "output_tokens": r.output_tokens,
                    "sent_s": round(r.start - first, 4) if r.start else None,
                    "ttft_ms": r.ttft * 1000 if r.ok else None, "e2e_ms": r.e2e * 1000 if r.ok else None,
                    "itl_ms": [g * 1000 for g in r.itls], "ttft_breakdown_ms": r.ttft_breakdown, "error": r.error}
                   for r in records]
    path.write_text(json.dumps({"config": config, "summary": summary.to_dict(), "requests": per_request}, indent=1))


def write_plot(path: Path, summary: Summary, records: list[RequestRecord], title: str) -> None:
    """Histograms of TTFT, ITL and end-to-end latency, with p50 and p99 marked."""
    import matplotlib

    matplotlib.use("Agg")  # no display; only files
    import matplotlib.pyplot as plt

    done = [r for r in records if r.ok]
    series = (("TTFT", [r.ttft * 1000 for r in done], summary.ttft),
              ("ITL", [g * 1000 for r in done for g in r.itls], summary.itl),
              ("End-to-end latency", [r.e2e * 1000 for r in done], summary.e2e))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (name, values, dist) in zip(axes, series):
        ax.hist(values, bins=50, color="tab:blue", alpha=0.8)
        for stat, style in (("p50", "--"), ("p99", ":")):
            if dist.count:
                ax.axvline(getattr(dist, stat), color="tab:red", linestyle=style, label=f"{stat} {getattr(dist, stat):.1f} ms")
        ax.set(title=f"{name} (n={len(values)})", xlabel="ms", ylabel="count")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

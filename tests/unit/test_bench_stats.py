"""`disagg bench`'s arithmetic: length distributions, arrivals, per-request timings, the summary and its files."""
from __future__ import annotations

import asyncio
import json
import math
import random
import time

import numpy as np
import pytest

from services.cli.bench.clients import OpenAIClient, SendOptions
from services.cli.bench.report import format_breakdown, format_table, write_json, write_plot
from services.cli.bench.runner import LoadShape, run_load
from services.cli.bench.stats import Distribution, RequestRecord, SloLimits, summarize
from services.cli.bench.workload import LengthDist, arrival_gaps, make_requests


def _record(index: int, start: float, token_times: list[float], tokens: int | None = None, prompt: int = 10,
            error: str | None = None) -> RequestRecord:
    r = RequestRecord(index, prompt, 8, start=start, token_times=token_times,
                      output_tokens=len(token_times) if tokens is None else tokens, error=error)
    r.end = token_times[-1] if token_times else start
    return r


def test_length_dist_parses_every_form_and_rejects_bad_ones():
    assert LengthDist.parse("7") == LengthDist("fixed", 7)
    assert LengthDist.parse("uniform:100:1024") == LengthDist("uniform", 100, 1024)
    assert LengthDist.parse("normal:256:32").max == 256 + 4 * 32
    for bad in ("uniform:10", "uniform:20:10", "fixed:0", "gamma:1:2", "normal:x:1", "normal:10:-1"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_samples_follow_their_distribution():
    rng = random.Random(0)
    uniform = [LengthDist.parse("uniform:100:200").sample(rng) for _ in range(5000)]
    assert min(uniform) >= 100 and max(uniform) <= 200 and abs(np.mean(uniform) - 150) < 3
    normal = [LengthDist.parse("normal:300:20").sample(rng) for _ in range(5000)]
    assert abs(np.mean(normal) - 300) < 2 and abs(np.std(normal) - 20) < 2
    assert {LengthDist.parse("fixed:5").sample(rng) for _ in range(10)} == {5}


def test_requests_are_reproducible_and_fit_the_context():
    a = make_requests(20, LengthDist.parse("uniform:10:300"), LengthDist.parse("uniform:1:100"), (100, 200), seed=3,
                      max_model_len=256)
    b = make_requests(20, LengthDist.parse("uniform:10:300"), LengthDist.parse("uniform:1:100"), (100, 200), seed=3,
                      max_model_len=256)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 256 and r.max_tokens >= 1 for r in a)
    assert all(100 <= t < 200 for r in a for t in r.prompt_token_ids)


def test_poisson_gaps_have_the_requested_rate_and_inf_sends_at_once():
    gaps = list(arrival_gaps(20000, 4.0, seed=0))
    assert abs(np.mean(gaps) - 0.25) < 0.01 and abs(np.std(gaps) - 0.25) < 0.01  # exponential: mean = std
    assert set(arrival_gaps(5, float("inf"), seed=0)) == {0.0}


def test_record_timings():
    r = _record(0, 1.0, [1.5, 1.6, 1.8, 2.1], tokens=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx(0.6 / 3)
    assert _record(1, 0.0, [0.2]).tpot is None


def test_distribution_matches_numpy_percentiles():
    values = [0.001 * i for i in range(1, 101)]
    d = Distribution.of(values)
    assert d.mean == pytest.approx(50.5) and d.p50 == pytest.approx(50.5)
    assert d.p90 == pytest.approx(np.percentile(np.arange(1, 101), 90))
    assert d.p99 == pytest.approx(np.percentile(np.arange(1, 101), 99)) and d.max == pytest.approx(100) and d.count == 100
    assert math.isnan(Distribution.of([]).mean)


def test_summary_throughput_goodput_and_failures():
    fast = _record(0, 0.0, [0.1, 0.15, 0.2], prompt=10)  # ttft 100 ms, tpot 50 ms
    slow_first = _record(1, 0.0, [0.9, 0.95, 1.0], prompt=20)  # ttft 900 ms
    slow_tokens = _record(2, 0.0, [0.1, 0.6, 1.1], prompt=30)  # tpot 500 ms
    failed = _record(3, 0.0, [], error="UNAVAILABLE: no decode worker")
    s = summarize([fast, slow_first, slow_tokens, failed], duration_s=2.0, slo=SloLimits(ttft_ms=200, tpot_ms=100))
    assert (s.completed, s.failed) == (3, 1)
    assert s.input_tokens == 60 and s.output_tokens == 9
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(4.5) and s.total_token_throughput == pytest.approx(34.5)
    assert s.goodput == pytest.approx(0.5)  # only `fast` meets both limits
    assert s.ttft.count == 3 and s.itl.count == 6
    assert s.errors == ["UNAVAILABLE: no decode worker"]
    assert summarize([fast], 1.0, SloLimits()).goodput is None


def test_table_json_and_plot_are_written(tmp_path):
    records = [_record(i, 0.0, [0.1 + 0.01 * i, 0.2 + 0.01 * i, 0.25 + 0.02 * i]) for i in range(20)]
    summary = summarize(records, 1.0, SloLimits(ttft_ms=150))
    table = format_table(summary, "Serving Benchmark Result")
    assert "Request goodput (req/s):" in table and "P99" in table
    write_json(tmp_path / "out.json", {"num_prompts": 20}, summary, records)
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["summary"]["completed"] == 20 and len(data["requests"]) == 20
    assert data["summary"]["ttft"]["p50"] == pytest.approx(summary.ttft.p50)
    pytest.importorskip("matplotlib")
    write_plot(tmp_path / "out.png", summary, records, "test")
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ttft_breakdown_is_summarised_per_part_over_the_requests_it_applies_to(tmp_path):
    disagg = [_record(i, 0.0, [0.050, 0.070]) for i in range(2)]  # client TTFT 50 ms
    for r in disagg:
        r.ttft_breakdown = {"router_queue_ms": 2.0, "prefill_queue_ms": 10.0, "prefill_compute_ms": 30.0,
                            "kv_handoff_ms": 4.0, "first_decode_step_ms": 8.0}
    aggregated = _record(2, 0.0, [0.020, 0.030])  # client TTFT 20 ms
    aggregated.ttft_breakdown = {"router_queue_ms": 1.0, "prefill_queue_ms": 3.0, "prefill_compute_ms": 12.0}
    summary = summarize([*disagg, aggregated, _record(3, 0.0, [0.04])], 1.0, SloLimits())  # the last reported none
    parts = summary.ttft_breakdown
    assert (parts["router_queue_ms"].count, parts["kv_handoff_ms"].count) == (3, 2)
    assert parts["prefill_compute_ms"].mean == pytest.approx(24.0) and parts["kv_handoff_ms"].mean == pytest.approx(4.0)
    assert sorted([parts["other_ms"].p50, parts["other_ms"].max]) == pytest.approx([8.0, 8.0])  # 50 - 42, 20 - 16
    table = format_breakdown(summary, "grpc")
    assert "TTFT breakdown" in table and "after the first token" in table
    row = next(line for line in table.splitlines() if line.startswith("prefill compute"))
    assert row.split()[2:4] == ["3", "24.00"]
    write_json(tmp_path / "out.json", {}, summary, [*disagg, aggregated])
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["requests"][2]["ttft_breakdown_ms"] == aggregated.ttft_breakdown
    assert data["summary"]["ttft_breakdown"]["kv_handoff_ms"]["count"] == 2


def test_other_splits_at_the_routers_own_ttft_into_its_side_and_the_clients():
    # client TTFT 50 ms; the router saw its first token 45 ms after the request reached it; its parts on the first
    # token's path add to 42: 3 ms router <-> worker, 5 ms client <-> router (a busy router's loop, the network)
    records = [_record(i, 0.0, [0.050, 0.070]) for i in range(2)]
    for r in records:
        r.ttft_breakdown = {"router_queue_ms": 2.0, "prefill_queue_ms": 10.0, "prefill_compute_ms": 30.0}
        r.router_ttft_ms = 45.0
    untimed = _record(2, 0.0, [0.020, 0.030])  # a router that reports no TTFT of its own: in `other` only
    untimed.ttft_breakdown = {"router_queue_ms": 1.0, "prefill_queue_ms": 3.0, "prefill_compute_ms": 12.0}
    parts = summarize([*records, untimed], 1.0, SloLimits()).ttft_breakdown
    assert parts["other_ms"].count == 3
    assert (parts["router_worker_ms"].count, parts["router_worker_ms"].mean) == (2, pytest.approx(3.0))
    assert (parts["client_router_ms"].count, parts["client_router_ms"].mean) == (2, pytest.approx(5.0))
    table = format_breakdown(summarize(records, 1.0, SloLimits()), "grpc")
    assert "  of it router <-> worker" in table and "  of it client <-> router" in table


def test_a_front_door_without_usage_says_there_is_no_breakdown():
    summary = summarize([_record(0, 0.0, [0.05, 0.06])], 1.0, SloLimits())
    assert summary.ttft_breakdown is None
    assert "KServe v2 does not carry" in format_breakdown(summary, "kserve")


class _Client:
    """A front door's client that waits (a server's tokens) or keeps its loop busy (a client at its ceiling)."""

    def __init__(self, burn_s: float):
        self.burn_s = burn_s

    async def one(self, request, options, record):
        if self.burn_s:
            begun = time.thread_time()
            while time.thread_time() - begun < self.burn_s:  # CPU on the loop's thread, as timing tokens takes
                pass
        else:
            await asyncio.sleep(0.05)
        record.output_tokens = 1


def _share_of_a_core(burn_s: float = 0.1) -> float:
    """CPU seconds over wall of a thread that only computes, now: ~1 on an idle machine, less where other processes
    take the cores (a loaded CI machine gave the busy client 0.27)."""
    cpu_at, wall_at = time.thread_time(), time.perf_counter()
    while time.thread_time() - cpu_at < burn_s:
        pass
    return min(1.0, burn_s / (time.perf_counter() - wall_at))


@pytest.mark.parametrize("burn_s, busy", [(0.0, False), (0.04, True)], ids=["waiting", "busy"])
def test_the_sending_loops_busy_share_tells_a_busy_client_from_a_waiting_one(burn_s, busy):
    requests = make_requests(4, LengthDist.parse("fixed:8"), LengthDist.parse("fixed:2"), (10, 100), seed=0)
    before = _share_of_a_core()
    sent = asyncio.run(run_load(_Client(burn_s), requests, LoadShape(), SendOptions("m", 0.0, True, 10.0, "t")))
    share = min(before, _share_of_a_core())
    assert len(sent.records) == 4 and len(sent.loop_busy) == 1
    # CPU seconds over wall: the waiting client ~0, the busy one all of the share of a core the machine leaves it
    if busy:
        assert sent.loop_busy[0] > 0.3 * share, (sent.loop_busy, share)
    else:
        assert sent.loop_busy[0] < 0.1, (sent.loop_busy, share)


def test_the_table_names_a_client_loop_at_its_ceiling():
    record = _record(0, 1.0, [1.05, 1.1])
    calm = summarize([record], 1.0, SloLimits(None, None), [0.3, 0.5])
    assert "Client loop busy (cores, max of 2):" in format_table(calm, "t") and "note:" not in format_table(calm, "t")
    hot = summarize([record], 1.0, SloLimits(None, None), [0.91])
    assert "0.91 of a core busy" in format_table(hot, "t")
    assert hot.to_dict()["client_loop_busy"] == [0.91]


def test_a_completion_event_with_its_text_held_back_is_an_arrival_and_the_finish_event_is_not() -> None:
    """The server streams an event a token, "" while a partial character is held back (openai_responses.py): each is
    one arrival, as vLLM's bench counts them, or the ITL of a model emitting byte tokens would read k steps a gap."""
    record = RequestRecord(0, 3, 4)
    for text, reason in (("a", None), ("", None), ("", None), ("b", None), ("", "length")):
        OpenAIClient._chunk({"choices": [{"index": 0, "text": text, "finish_reason": reason}]}, record)
    OpenAIClient._chunk({"choices": [], "usage": {"completion_tokens": 4}}, record)
    assert (len(record.token_times), record.output_tokens) == (4, 4)

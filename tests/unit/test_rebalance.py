"""The rebalancer's decisions on synthetic metric series: a move only after N windows in a row want it, never
within the cooldown, never below a role's minimum; and the windows' figures as Prometheus would compute them."""
from __future__ import annotations

import pytest

from services.planner.rebalance import ITL, REQUESTS, TTFT, Rebalancer, Window, histogram_quantile, parse, window
from services.planner.workload import parse_slo

SLO = parse_slo("ttft_p90=250ms,itl_p99=15ms")


def w(ttft: float, itl: float, requests: float = 50) -> Window:
    return Window(10.0, requests, requests * 1000, requests * 128, {"ttft_p90": ttft, "itl_p99": itl},
                  {"prefill": 3, "decode": 0})


def run(rebalancer: Rebalancer, series, counts, start=0.0, step=10.0):
    """Each window of `series` in turn, applying the moves to `counts`; the moves and the log lines."""
    moves, lines = [], []
    for i, window_ in enumerate(series):
        move, line = rebalancer.observe(window_, counts, start + i * step)
        lines.append(line)
        if move is not None:
            counts[move.source] -= 1
            counts[move.target] += 1
            moves.append((i, move.source, move.target))
    return moves, lines


def test_a_move_needs_the_same_want_in_n_windows_in_a_row():
    rebalancer = Rebalancer(SLO, {"prefill": 0, "decode": 1}, windows=3, cooldown_s=0)
    ttft_high = w(0.6, 0.005)  # prefill 2.4x its SLO, decode 0.33x
    moves, lines = run(rebalancer, [ttft_high, ttft_high, w(0.1, 0.005), ttft_high, ttft_high, ttft_high],
                       {"prefill": 1, "decode": 3})
    assert moves == [(5, "decode", "prefill")]  # the calm window broke the first streak
    assert "1 of 3 windows" in lines[0] and "2 of 3 windows" in lines[1] and "hold (neither" in lines[2]
    assert "move a decode worker to prefill" in lines[5]
    assert "ttft_p90 600 ms" in lines[5] and "2.40x" in lines[5] and "50 req/s" not in lines[5]
    assert "5.00 req/s" in lines[5] and "prompt 1000 / output 128 tokens" in lines[5] and "waiting: decode 0" in lines[5]


def test_no_move_within_the_cooldown_and_none_past_a_minimum():
    rebalancer = Rebalancer(SLO, {"prefill": 1, "decode": 1}, windows=1, cooldown_s=25)
    itl_high = w(0.05, 0.045)  # decode 3x its SLO
    counts = {"prefill": 3, "decode": 1}
    moves, lines = run(rebalancer, [itl_high] * 6, counts)
    assert moves == [(0, "prefill", "decode"), (3, "prefill", "decode")]  # 30 s apart: the windows between cool down
    assert "cooling down" in lines[1] and "cooling down" in lines[2]
    assert counts == {"prefill": 1, "decode": 3}
    assert "keeps its minimum of 1" in lines[5]


def test_a_window_without_traffic_holds_and_breaks_the_streak():
    rebalancer = Rebalancer(SLO, {"prefill": 0, "decode": 1}, windows=2, cooldown_s=0)
    high = w(0.6, 0.005)
    moves, lines = run(rebalancer, [high, w(0, 0, requests=0), high, high], {"prefill": 0, "decode": 2})
    assert moves == [(3, "decode", "prefill")] and "no traffic" in lines[1]


def test_both_roles_over_their_slo_alike_is_no_reason_to_move():
    rebalancer = Rebalancer(SLO, {"prefill": 0, "decode": 1}, windows=1, cooldown_s=0, ratio=1.5)
    moves, lines = run(rebalancer, [w(0.5, 0.03)] * 3, {"prefill": 1, "decode": 1})  # 2x and 2x
    assert moves == [] and all("neither role" in line for line in lines)


def _histogram(name: str, counts: dict[str, float], requests: float) -> str:
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{le="{le}",model="m",role="router"}} {n}' for le, n in counts.items()]
    lines += [f'{name}_count{{model="m",role="router"}} {counts["+Inf"]}']
    lines += ["# TYPE disagg_requests_total counter", f'{REQUESTS}{{status="OK"}} {requests}']
    return "\n".join(lines) + "\n"


def test_quantiles_come_from_the_histogram_increase_over_the_window():
    before = parse(_histogram(TTFT, {"0.1": 10, "0.25": 10, "0.5": 10, "+Inf": 10}, 10))
    after = parse(_histogram(TTFT, {"0.1": 10, "0.25": 60, "0.5": 110, "+Inf": 110}, 110))
    # 100 new observations: 50 in (0.1, 0.25], 50 in (0.25, 0.5]; the p90 is 80% into the second bucket
    assert histogram_quantile(0.9, before, after, TTFT) == pytest.approx(0.25 + 0.25 * 0.8)
    assert histogram_quantile(0.5, before, after, TTFT) == pytest.approx(0.25)
    assert histogram_quantile(0.9, after, after, TTFT) is None  # nothing observed in between
    got = window(before, after, 10.0, SLO)
    assert got.requests == 100 and got.rate == 10.0
    assert got.quantiles["ttft_p90"] == pytest.approx(0.45) and got.quantiles["itl_p99"] is None


def test_an_observation_past_the_last_bucket_reads_as_its_bound():
    before = parse(_histogram(ITL, {"0.01": 0, "0.1": 0, "+Inf": 0}, 0))
    after = parse(_histogram(ITL, {"0.01": 0, "0.1": 0, "+Inf": 5}, 5))
    assert histogram_quantile(0.99, before, after, ITL) == 0.1

"""The planner's prediction on synthetic profiles: the fits recover the costs they were made from, the ranking
follows the workload and the SLO as the cost model says it must, and every figure is the same for the same seed."""
from __future__ import annotations

import pytest

from services.planner.layouts import Layout, cpu_layouts, cuda_layouts, thresholds
from services.planner.predict import Predictor
from services.planner.profile import Limits, Profile, StepCosts, UnitProfile, prompt_steps
from services.planner.simulate import make_requests, simulate
from services.planner.workload import parse_slo, parse_workload

LIMITS = Limits(step_tokens=8192, chunk_tokens=8192, max_num_seqs=128, max_model_len=8192)


def synthetic_unit(limits: Limits = LIMITS, step_s=0.004, tokens_per_s=40_000.0, attention_s=0.0,
                   decode_s=0.008, row_s=2e-5, context_s=2e-9, handoff=(0.001, 1e-7)) -> UnitProfile:
    """What an engine of exactly these costs would have measured (the profiler's points)."""
    prefill = []
    for batch in (1, 4):
        for length in (256, 1024, 4096):
            steps = prompt_steps([length] * batch, limits)
            seconds = sum(step_s + sum(c for c, _ in s) / tokens_per_s + attention_s * sum(c * (b + c) for c, b in s)
                          for s in steps)
            prefill.append({"batch": batch, "prompt_len": length, "seconds": seconds})
    decode = [{"batch": b, "context": c, "step_s": decode_s + row_s * b + context_s * b * c}
              for b in (1, 16, 64) for c in (256, 2048)]
    handoffs = [{"tokens": t, "seconds": handoff[0] + handoff[1] * t} for t in (256, 2048)]
    return UnitProfile(prefill, decode, handoffs)


def gpu_profile(**costs) -> Profile:
    return Profile("k", "m", "cuda: synthetic", {}, LIMITS, {"gpus=1": synthetic_unit(**costs)})


def ranked(profile: Profile, workload: str, slo: str, gpus: int = 2, requests: int = 400):
    w, s = parse_workload(workload), parse_slo(slo)
    return Predictor(profile, w, s, requests=requests).rank(cuda_layouts(gpus, (1,), thresholds(w)))


def test_the_fits_recover_the_costs_the_measurements_were_made_of():
    limits = Limits(2048, 512, 32, 8192)  # chunked: a 4096-token prompt takes 8 steps
    costs = StepCosts(synthetic_unit(limits, step_s=0.003, tokens_per_s=10_000, attention_s=1e-9), limits)
    assert costs.prefill_coef == pytest.approx([0.003, 1e-4, 1e-9], rel=1e-6)
    assert costs.decode_coef == pytest.approx([0.008, 2e-5, 2e-9], rel=1e-6)
    assert costs.handoff(1000) == pytest.approx(0.001 + 1e-4)
    assert costs.mixed_step(4, 4000, [(512, 0)]) == pytest.approx(
        costs.decode_step(4, 4000) + costs.prefill_step([(512, 0)]) - 0.003)


def test_prompt_heavy_work_under_a_tight_itl_ranks_the_split_first():
    """A 2048-token prompt prefilled beside the decodes makes a 55 ms step: every aggregated layout breaks a 15 ms ITL
    p99, and so does a threshold that keeps long prompts local; 1P1D meets it."""
    ranking = ranked(gpu_profile(), "in=512-2048,out=128,rate=20", "ttft_p90=250ms,itl_p99=15ms")
    best = ranking[0]
    assert (best.layout.prefill, best.layout.decode, best.layout.max_local_prefill_tokens) == (1, 1, 0)
    assert best.at_rate.meets and best.goodput >= 20
    aggregated = next(p for p in ranking if p.layout.prefill == 0)
    assert not aggregated.at_rate.meets and aggregated.at_rate.values["itl_p99"] > 0.015
    assert aggregated.goodput < best.goodput / 2


def test_decode_heavy_work_under_a_loose_itl_ranks_aggregated_first():
    """Short prompts, long outputs, an ITL limit the mixed steps keep: two GPUs decoding serve more than one."""
    ranking = ranked(gpu_profile(), "in=256,out=1024", "ttft_p90=1s,itl_p99=50ms")
    best, split = ranking[0], next(p for p in ranking if p.layout.prefill == 1)
    assert best.layout.describe() == "2 x aggregated"
    assert best.goodput > 1.3 * split.goodput
    # one decode GPU's capacity bounds the split: 128 rows at ~10.6 ms a step is ~12 req/s of 1024 tokens
    assert split.goodput < 15


def test_an_slo_no_layout_can_meet_gives_no_goodput_and_is_marked_unmet():
    ranking = ranked(gpu_profile(), "in=512-2048,out=128,rate=5", "ttft_p90=1ms,itl_p99=15ms")
    assert all(p.goodput == 0 and not p.at_rate.meets for p in ranking)


def test_a_tighter_slo_never_raises_goodput():
    loose = {p.layout: p.goodput for p in ranked(gpu_profile(), "in=512-2048,out=128", "ttft_p90=500ms,itl_p99=50ms")}
    tight = {p.layout: p.goodput for p in ranked(gpu_profile(), "in=512-2048,out=128", "ttft_p90=100ms,itl_p99=15ms")}
    assert all(tight[layout] <= loose[layout] for layout in loose)
    assert any(tight[layout] < loose[layout] for layout in loose)


def test_predictions_are_deterministic_for_a_seed_and_follow_it():
    w, s = parse_workload("in=512-2048,out=64,rate=10"), parse_slo("ttft_p90=250ms,itl_p99=15ms")
    layout = Layout(1, 1, ("gpus=1", "gpus=1"))
    one = Predictor(gpu_profile(), w, s, requests=200, seed=7).predict(layout)
    two = Predictor(gpu_profile(), w, s, requests=200, seed=7).predict(layout)
    other = Predictor(gpu_profile(), w, s, requests=200, seed=8).predict(layout)
    assert one == two
    assert other.at_rate.values != one.at_rate.values


def test_the_simulation_keeps_every_request_and_its_order_of_events():
    costs = StepCosts(synthetic_unit(), LIMITS)
    requests = make_requests(parse_workload("in=100-900,out=1-40"), 300, rate=30.0, seed=1)
    for prefill, local in ((0, 0), (1, 0), (1, 400)):
        result = simulate([costs] * prefill, [costs] * (2 - prefill), local, requests)
        assert len(result.requests) == 300
        assert all(r.arrival < r.first_token <= r.last_token for r in result.requests)
        assert all(r.last_token - r.first_token >= (r.output - 1) * costs.decode_step(1, 0) * 0.999
                   for r in result.requests)


def test_overload_is_caught_by_the_backlog_even_where_the_quantiles_hide_it():
    """Far past one decode GPU's capacity, a request waiting for a decode slot is one gap among a thousand: the ITL
    p99 stays low, but the queue grows with every arrival and the rate is not met."""
    w, s = parse_workload("in=256,out=1024"), parse_slo("ttft_p90=1s,itl_p99=50ms")
    figures = Predictor(gpu_profile(), w, s, requests=600).at(Layout(1, 1, ("gpus=1", "gpus=1")), rate=40.0)
    assert figures.values["itl_p99"] < 0.05 and figures.values["backlog_growth"] > 1.5
    assert not figures.meets


def test_layouts_cover_every_split_and_threshold_of_the_devices():
    w = parse_workload("in=512-2048,out=128")
    cuts = thresholds(w)
    assert cuts[0] == 0 and all(512 <= c < 2048 for c in cuts[1:]) and len(cuts) == 4
    four = cuda_layouts(4, (1, 2), cuts)
    described = {layout.describe() for layout in four}
    assert {"4 x aggregated", "1P3D", "2P2D", "3P1D", "2 x aggregated TP2", "1P1D TP2"} <= described
    assert len(four) == 1 + 3 * len(cuts) + 1 + 1 * len(cuts)
    cpu = cpu_layouts((0, 1, 2, 3), [0])
    assert [(c.prefill, c.decode, c.units) for c in cpu if c.prefill + c.decode == 2] == [
        (0, 2, ("cores=1", "cores=2")), (1, 1, ("cores=1", "cores=2"))]  # up's cpu_layout: a core left for the router
    assert Layout(1, 3, ("gpus=1",) * 4, 1024).up_flags() == ["--prefill", "1", "--decode", "3",
                                                              "--max-local-prefill-tokens", "1024"]

"""A plan saved by `disagg plan --save` starts as the same layout under `disagg up --plan`, and up's planning flags
are checked together before anything starts."""
from __future__ import annotations

import pytest

from services.cli.up import parse_args, plan, router_argv
from services.planner.layouts import Layout, load_plan, save_plan
from common.errors import InvalidConfig


@pytest.mark.parametrize("layout", [Layout(1, 3, ("gpus=1",) * 4, 1024), Layout(0, 2, ("cores=1", "cores=1")),
                                    Layout(1, 1, ("gpus=2",) * 2, 0, 2)])
def test_a_saved_plan_loads_back_as_the_same_layout(layout, tmp_path):
    path = tmp_path / "plan.json"
    save_plan(path, layout, {"predicted": {"goodput_rps": 3.0}})
    assert load_plan(str(path)) == layout


def test_up_plan_starts_the_saved_layout_with_its_threshold(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(path, Layout(1, 2, ("cores=1",) * 3, 768), {})
    args = parse_args(["--model", "/m", "--plan", str(path)])
    settled = plan(args, cores=(0, 1, 2, 3))
    assert [w.name for w in settled.workers] == ["prefill-0", "decode-0", "decode-1"]
    assert settled.max_local_prefill_tokens == 768 and "from --plan" in settled.why
    argv = router_argv(args, settled, {"prefill": "h:1", "decode": "h:2,h:3"}, 0)
    assert argv[argv.index("--max-local-prefill-tokens") + 1] == "768"


def test_up_plan_of_an_aggregated_layout_starts_decode_workers_alone(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(path, Layout(0, 2, ("cores=1",) * 2), {})
    settled = plan(parse_args(["--model", "/m", "--plan", str(path)]), cores=(0, 1))
    assert [w.name for w in settled.workers] == ["decode-0", "decode-1"]


@pytest.mark.parametrize("flags, message", [
    (["--prefill", "1"], "leave those out"),
    (["--workload", "in=8,out=8", "--slo", "ttft_p90=1s"], "give one of them"),
])
def test_up_refuses_a_plan_beside_flags_that_would_choose_otherwise(flags, message, tmp_path, capsys):
    path = tmp_path / "plan.json"
    save_plan(path, Layout(1, 1, ("cores=1",) * 2), {})
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "/m", "--plan", str(path), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--workload", "in=8,out=8"], "give both"),
    (["--planner"], "give --slo"),
    (["--planner", "--slo", "itl_p99=15ms", "--metrics-port-base", "-1"], "turns them off"),
    (["--planner", "--slo", "itl_p99=15ms", "--planner-min-decode", "0"], "--planner-min-decode must be >= 1"),
])
def test_up_checks_its_planning_flags_together(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "/m", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_file_that_is_no_plan_is_refused_with_its_name(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"layout": {"prefill": 1}}')
    with pytest.raises(InvalidConfig, match="other.json: not a plan"):
        load_plan(str(path))
    path.write_text('{"layout": {"prefill": 1, "decode": 0, "units": []}}')
    with pytest.raises(InvalidConfig, match="needs a decode worker"):
        load_plan(str(path))


def test_the_planner_gives_the_router_every_slot_port_of_both_roles():
    from services.cli.roles import reserve_slots, slot_addresses

    args = parse_args(["--model", "/m", "--prefill", "1", "--decode", "1", "--planner", "--slo", "ttft_p90=1s"])
    settled = plan(args, cores=(0, 1))
    slots = reserve_slots(settled.workers, "127.0.0.1")
    addresses = slot_addresses(slots, "127.0.0.1")
    ports = {p for s in slots for p in s.ports.values()}
    assert len(ports) == 4  # a port per role per slot, none shared
    assert addresses["prefill"].count(",") == 1 and addresses["decode"].count(",") == 1
    argv = router_argv(args, settled, addresses, 0)
    assert argv[argv.index("--prefill-workers") + 1] == addresses["prefill"]
    assert "--worker-wait=2.0" in argv  # after routing_argv's own, so it wins

"""`disagg up --help` fits a screen (60 lines at 80 columns) and shows a line of help a flag; `--help-all` lists every
flag up takes, and the router's flags up takes reach the router's command line."""
from __future__ import annotations

import argparse

import pytest

from services.cli.up import parse_args, plan, router_argv, worker_argv
from services.cli.up_flags import SHOWN, build_parser
from services.router.config import add_router_args


@pytest.fixture(autouse=True)
def eighty_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [a.option_strings[-1] for a in parser._actions if a.option_strings]


def test_up_help_fits_sixty_lines_of_eighty_columns():
    text = build_parser().format_help()
    lines = text.splitlines()
    assert len(lines) <= 60, text
    assert max(len(line) for line in lines) <= 80, text


def test_up_help_shows_the_common_flags_and_help_all_every_flag(capsys):
    short = build_parser().format_help()
    every = build_parser(show_all=True).format_help()
    parser = build_parser()
    shown = [a.option_strings[-1] for a in parser._actions if a.option_strings and a.dest in SHOWN]
    assert all(flag in short for flag in shown)
    assert "--migration-limit" not in short and "--help-all" in short
    assert all(flag in every for flag in _flags(parser)), [f for f in _flags(parser) if f not in every]
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help-all"])
    assert exit_.value.code == 0 and capsys.readouterr().out == every


def test_up_passes_the_router_flags_it_takes_to_the_router():
    args = parse_args(["--model", "/m", "--migration-limit", "2", "--decode-streams", "per-request",
                       "--max-inflight-requests", "9", "--drain-timeout", "5", "--policy", "kv_aware"])
    settled = plan(args, cores=(0, 1))
    argv = router_argv(args, settled, {"prefill": "h:1", "decode": "h:2"}, 0)
    router = argparse.ArgumentParser()
    add_router_args(router)
    router.add_argument("--metrics-port", type=int)
    parsed = router.parse_args(argv)
    assert (parsed.migration_limit, parsed.decode_streams, parsed.max_inflight_requests, parsed.drain_timeout,
            parsed.policy) == (2, "per-request", 9, 5.0, "kv_aware")
    worker = worker_argv(args, settled, settled.workers[0], 0)
    assert worker[worker.index("--drain-timeout") + 1] == "5.0" and worker[worker.index("--port") + 1] == "0"


def test_up_passes_the_worker_flags_it_takes_to_each_worker():
    """--model-name and the KV handoff flags, which are no engine flags, reach the workers' command lines; the pull
    flags the decode workers' alone."""
    args = parse_args(["--model", "/m", "--model-name", "sea", "--kv-transports", "grpc", "--kv-pull-timeout", "5",
                       "--kv-load-failure-policy", "fail"])
    settled = plan(args, cores=(0, 1))
    argv = {w.role: worker_argv(args, settled, w, 0) for w in settled.workers}
    assert settled.model_name == "sea"
    for role in ("prefill", "decode"):
        assert argv[role][argv[role].index("--model-name") + 1] == "sea" and "--kv-transports=grpc" in argv[role]
    assert {"--kv-pull-timeout=5.0", "--kv-load-failure-policy=fail"} <= set(argv["decode"])
    assert not any(a.startswith("--kv-pull-timeout") for a in argv["prefill"])


def test_up_help_reads_the_same_with_more_policies_registered(monkeypatch):
    """A policy a plugin (or another test) registers is a choice of --policy, but not a line more of --help."""
    from services.router import policies

    before = build_parser().format_help()
    monkeypatch.setitem(policies._REGISTRY._entries, "a_plugin_policy_with_a_long_name", "plugin:Policy")
    assert "a_plugin_policy_with_a_long_name" in build_parser()._option_string_actions["--policy"].choices
    assert build_parser().format_help() == before

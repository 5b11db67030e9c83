"""The profile cache: one key per model, device kind, engine config and units; a hit measures nothing, a miss
measures and stores; a profile of another profiler version or key is not taken."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from benchmarks.text_model import make_text_model
from services.cli import plan as plan_cli
from services.planner import profile as cache
from services.planner.layouts import Devices
from services.planner.profile import Limits, Profile, UnitProfile, model_identity, profile_key
from services.planner import profiler


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_text_model(tmp_path_factory.mktemp("models") / "tiny"))


def _args(model: str, *more: str) -> argparse.Namespace:
    return plan_cli._parser().parse_args(["--model", model, "--workload", "in=32,out=8", "--slo", "ttft_p90=1s",
                                          *more])


def _measured(calls: list):
    def fake(config, unit, grid, log):
        calls.append((unit, config.max_num_seqs, grid))
        return (UnitProfile([{"batch": 1, "prompt_len": 32, "seconds": 0.01}],
                            [{"batch": 1, "context": 40, "step_s": 0.002}]),
                Limits(config.max_num_batched_tokens, 128, config.max_num_seqs, 256))
    return fake


def test_a_second_plan_takes_the_profile_from_the_cache_and_another_config_measures_again(model_dir, tmp_path,
                                                                                        monkeypatch):
    calls: list = []
    monkeypatch.setattr(profiler, "profile_unit", _measured(calls))
    devices = Devices("cpu", (0, 1), "test cpu")
    first = plan_cli.get_profile(_args(model_dir), devices, ["cores=1"], log=lambda m: None, directory=tmp_path)
    assert [c[0] for c in calls] == ["cores=1"] and (tmp_path / f"{first.key}.json").is_file()
    again = plan_cli.get_profile(_args(model_dir), devices, ["cores=1"], log=lambda m: None, directory=tmp_path)
    assert again == first and len(calls) == 1  # a hit: nothing measured
    other = plan_cli.get_profile(_args(model_dir, "--max-num-seqs", "4"), devices, ["cores=1"], log=lambda m: None,
                                 directory=tmp_path)
    assert other.key != first.key and len(calls) == 2 and calls[-1][1] == 4
    forced = plan_cli.get_profile(_args(model_dir, "--reprofile"), devices, ["cores=1"], log=lambda m: None,
                                  directory=tmp_path)
    assert forced.key == first.key and len(calls) == 3


def test_the_key_follows_the_model_the_device_the_engine_config_and_the_units(model_dir, tmp_path):
    model = model_identity(model_dir)
    base = profile_key(model, "cpu: x", {"dtype": "float32"}, ["cores=1"])
    assert base == profile_key(model, "cpu: x", {"dtype": "float32"}, ["cores=1"])
    assert base != profile_key(model, "cuda: NVIDIA H200", {"dtype": "float32"}, ["cores=1"])
    assert base != profile_key(model, "cpu: x", {"dtype": "bfloat16"}, ["cores=1"])
    assert base != profile_key(model, "cpu: x", {"dtype": "float32"}, ["cores=1", "cores=2"])
    other = make_text_model(tmp_path / "longer", max_position_embeddings=512)  # another config.json
    assert base != profile_key(model_identity(str(other)), "cpu: x", {"dtype": "float32"}, ["cores=1"])


def test_a_cached_profile_of_another_version_or_key_is_a_miss(tmp_path):
    profile = Profile("abc", "m", "cpu: x", {}, Limits(2048, 128, 32, 256), {"cores=1": UnitProfile()})
    path = cache.store(profile, tmp_path)
    assert cache.cached("abc", tmp_path) == profile
    assert cache.cached("other", tmp_path) is None
    path.write_text(json.dumps({**json.loads(path.read_text()), "version": cache.PROFILE_VERSION + 1}))
    assert cache.cached("abc", tmp_path) is None
    path.write_text("{not json")
    assert cache.cached("abc", tmp_path) is None
    moved = dataclasses.replace(profile, key="def")
    (tmp_path / "abc.json").write_text(moved.to_json())  # a file under a name not its key
    assert cache.cached("abc", tmp_path) is None

"""The node-wide KV tier in the engine (CPU): with --kv-cache-write-through, a finished request's full blocks reach the
shared disk directory at once, so another engine on it (the next turn's prefill worker) serves the prompt and the
answer from there with the greedy tokens of an engine without tiers; each block is written once; and `disagg up
--shared-kv-cache` gives every worker the one directory, the one budget and the switch, where without it each worker
gets a directory of its own."""
from __future__ import annotations

import shutil

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from common.errors import InvalidConfig
from services.cli import kv_tiers
from services.cli.up import parse_args, plan, worker_argv

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _engine(model: str, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, **{"block_size": BLOCK, "num_kv_blocks": 64, **overrides}))


def _shared(tmp_path, write_through: bool = True) -> dict:
    return {"disk_kv_cache_dir": str(tmp_path / "node"), "disk_kv_cache_gb": 0.05,
            "kv_cache_write_through": write_through}


def _prompt() -> list[int]:
    return torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(58)).tolist()


def _turns(first: LLMEngine, second: LLMEngine) -> tuple[list[int], list[int], list[int]]:
    """Turn 1 on `first`, turn 2 (turn 1's prompt, its answer and more) on `second`: the answers and turn 2's prompt."""
    prompt = _prompt()
    answer = first.generate([prompt], GREEDY)[0]
    if first.kv_tiers is not None:
        assert first.kv_tiers.mover.drain()
    following = prompt + answer + [7, 8, 9, 10, 11, 12]
    return answer, second.generate([following], GREEDY)[0], following


def _hit_tokens(engine: LLMEngine) -> float:
    return engine.kv_tiers.metrics.total("disagg_kv_tier_hit_tokens_total", tier="disk")


def test_a_finished_answer_written_through_serves_the_next_turn_on_another_engine(tiny_llama, tmp_path):
    plain = _turns(_engine(tiny_llama), _engine(tiny_llama))
    decode, prefill = _engine(tiny_llama, **_shared(tmp_path)), _engine(tiny_llama, **_shared(tmp_path))
    answer, second, following = _turns(decode, prefill)
    assert (answer, second) == plain[:2]
    computed = len(_prompt()) + len(answer) - 1  # the last token sampled is never computed
    assert _hit_tokens(prefill) == computed // BLOCK * BLOCK  # the prompt and the answer, from the other's writes
    assert prefill.block_manager.prefix_hit_tokens == computed // BLOCK * BLOCK
    assert decode.block_manager.num_free_blocks == 64  # its blocks were freed, and stay cached on its device
    assert decode.kv_tiers.metrics.total("disagg_kv_tier_evictions_total", tier="device") == 0
    assert prefill.block_manager.prefix_hit_tokens < len(following) - 1  # the new user text was computed


def test_without_write_through_the_other_engine_finds_nothing_until_an_eviction(tiny_llama, tmp_path):
    decode = _engine(tiny_llama, **_shared(tmp_path, write_through=False))
    prefill = _engine(tiny_llama, **_shared(tmp_path, write_through=False))
    _turns(decode, prefill)
    assert _hit_tokens(prefill) == 0 and prefill.block_manager.prefix_hit_tokens == 0
    assert not list((tmp_path / "node").rglob("*.kv"))  # the blocks never left the first engine's device pool


def test_write_through_stores_each_block_once(tiny_llama, tmp_path):
    engine = _engine(tiny_llama, **_shared(tmp_path))
    disk, writes = engine.kv_tiers.disk, []
    write = disk.write
    disk.write = lambda block: writes.append(block.key.hash) or write(block)  # (the count skips files there)
    prompt = _prompt()
    for _ in range(3):
        engine.generate([prompt], GREEDY)
        assert engine.kv_tiers.mover.drain()
    written = engine.kv_tiers.metrics.total("disagg_kv_tier_offload_blocks_total", tier="disk")
    full = (len(prompt) + GREEDY.max_tokens - 1) // BLOCK
    assert written == full == len(list((tmp_path / "node").rglob("*.kv"))) == len(writes) == len(set(writes))


def test_write_through_needs_a_disk_tier(tiny_llama):
    with pytest.raises(InvalidConfig, match="--kv-cache-write-through"):
        EngineConfig(model=tiny_llama, kv_cache_write_through=True)


def _worker_lines(argv: list[str]) -> dict[str, list[str]]:
    args = parse_args(argv)
    settled = plan(args)
    return {w.name: worker_argv(args, settled, w, 0) for w in settled.workers}


def _value(line: list[str], flag: str) -> str | None:
    return line[line.index(flag) + 1] if flag in line else None


def test_up_shared_kv_cache_gives_every_worker_one_directory_budget_and_write_through(tmp_path):
    lines = _worker_lines(["--shared-kv-cache", "--disk-kv-cache-dir", str(tmp_path / "node"), "--prefill", "1",
                           "--decode", "2"])
    assert set(lines) == {"prefill-0", "decode-0", "decode-1"}
    dirs = {_value(line, "--disk-kv-cache-dir") for line in lines.values()}
    budgets = {_value(line, "--disk-kv-cache-gb") for line in lines.values()}
    assert dirs == {str(tmp_path / "node")} and len(budgets) == 1
    expected = min(shutil.disk_usage(tmp_path).free * kv_tiers.SHARE_OF_FREE / kv_tiers.GB, kv_tiers.MAX_DEFAULT_GB)
    assert float(budgets.pop()) == pytest.approx(expected, rel=0.05)
    assert all(line.count("--kv-cache-write-through") == 1 for line in lines.values())


def test_up_shared_kv_cache_keeps_a_budget_given_and_defaults_its_directory_per_host(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_tiers, "DEFAULT_ROOT", tmp_path / "kv-tiers")
    lines = _worker_lines(["--shared-kv-cache", "--disk-kv-cache-gb", "3", "--kv-cache-write-through"])
    for line in lines.values():
        assert _value(line, "--disk-kv-cache-gb") == "3.0"
        assert _value(line, "--disk-kv-cache-dir").startswith(str(tmp_path / "kv-tiers") + "/")
        assert line.count("--kv-cache-write-through") == 1


def test_up_without_shared_kv_cache_gives_each_worker_a_directory_of_its_own(tmp_path):
    lines = _worker_lines(["--disk-kv-cache-dir", str(tmp_path), "--disk-kv-cache-gb", "2"])
    assert {n: _value(line, "--disk-kv-cache-dir") for n, line in lines.items()} == \
        {n: str(tmp_path / n) for n in lines}
    assert not any("--kv-cache-write-through" in line for line in lines.values())
    assert not any("--disk-kv-cache-dir" in line for line in _worker_lines([]).values())

"""The KV tiers in the engine (CPU): a multi-turn chat on a device pool far smaller than its working set decodes the
same greedy tokens with a disk tier (and a host tier) as without, its prompts' blocks coming back from the tiers
instead of being recomputed; and every fault (a corrupted or truncated file, a record of another layout, another
model's or dtype's directory, a killed writer's temporary, a full disk or budget) recomputes, counted, and the
engine keeps serving."""
from __future__ import annotations

import argparse
import errno
import os

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.interface import EngineRequest
from common.engine.request import SamplingParams
from common.errors import InvalidConfig
from common.kv.tiers import KvTiers, TierLayout, TierMetrics, weights_identity
from common.kv.tiers.disk import DiskTier
from common.kv.tiers.host import HostTier
from common.kv.tiers.record import decode, encode_header
from services.worker.engine_flags import add_engine_args, engine_argv, engine_config_from_args

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TURNS = 2
BLOCKS = 24  # each prompt is 10 blocks of 4 tokens: the pool holds two of the six, so turn two misses on the device


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (40,), generator=g).tolist() for _ in range(6)]


def _engine(model: str, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, **{"block_size": 4, "num_kv_blocks": BLOCKS, **overrides}))


def _chat(engine: LLMEngine, turns: int = TURNS, prompts: list[list[int]] | None = None) -> list[list[int]]:
    """Each prompt in turn, `turns` times over, one at a time; the tiers' stores finish after each request."""
    outputs = []
    for _ in range(turns):
        for prompt in prompts or _prompts():
            outputs.append(engine.generate([prompt], GREEDY)[0])
            if engine.kv_tiers is not None:
                assert engine.kv_tiers.mover.drain()
    return outputs


def _total(engine: LLMEngine, name: str, **labels) -> float:
    return engine.kv_tiers.metrics.total(name, **labels)


def _records(root) -> list:
    return sorted(p for p in root.rglob("*.kv"))


@pytest.fixture(scope="module")
def baseline(tiny_llama) -> list[list[int]]:
    engine = _engine(tiny_llama)
    tokens = _chat(engine)
    assert engine.block_manager.prefix_hit_tokens == 0  # LRU kept nothing of a prompt until its next turn
    return tokens


def _disk(tmp_path, gb: float = 0.01) -> dict:
    return {"disk_kv_cache_dir": str(tmp_path / "kv"), "disk_kv_cache_gb": gb}


def test_a_disk_tier_gives_the_same_greedy_tokens_and_saves_the_second_turns_prefill(tiny_llama, baseline, tmp_path):
    engine = _engine(tiny_llama, **_disk(tmp_path))
    assert _chat(engine) == baseline
    saved = 6 * 9 * 4  # every full block of every prompt but its last token's
    assert _total(engine, "disagg_kv_tier_hit_tokens_total", tier="disk") == saved
    assert engine.block_manager.prefix_hit_tokens == saved
    assert _total(engine, "disagg_kv_tier_evictions_total", tier="device") > 0
    assert _total(engine, "disagg_kv_tier_offload_bytes_total", tier="disk") > 0
    assert not engine.kv_tiers.prefetches.staged  # every prefetch was taken at admission
    assert engine.block_manager.num_free_blocks == BLOCKS
    engine.close()


def test_a_restarted_worker_finds_its_blocks_on_disk(tiny_llama, baseline, tmp_path):
    first = _engine(tiny_llama, **_disk(tmp_path))
    _chat(first, turns=1)
    first.close()
    again = _engine(tiny_llama, **_disk(tmp_path))
    assert _chat(again, turns=1) == baseline[:6]
    assert _total(again, "disagg_kv_tier_hit_blocks_total", tier="disk") > 0


def test_a_host_tier_hands_its_lru_victims_to_disk_and_both_serve_hits(tiny_llama, baseline, tmp_path):
    engine = _engine(tiny_llama)
    bm, cache = engine.block_manager, engine.runner.kv_cache
    layout = TierLayout.of(engine.kv_layout, weights_identity(tiny_llama))
    metrics = TierMetrics()
    block_bytes = cache.view(torch.uint8)[:, :, 0].numel()
    host = HostTier(15 * block_bytes, block_bytes, pin=False)  # (on a GPU: pinned; the CPU has no host tier)
    disk = DiskTier(tmp_path / "kv", 1 << 24, layout, metrics)
    bm.tiers = KvTiers(cache, layout, host, disk, metrics, max_prefetch_blocks=BLOCKS)
    assert _chat(engine, turns=1) == baseline[:6]
    assert _chat(engine, turns=1, prompts=_prompts()[::-1]) == baseline[:6][::-1]  # the latest evicted first
    assert _total(engine, "disagg_kv_tier_hit_blocks_total", tier="host") > 0
    assert _total(engine, "disagg_kv_tier_hit_blocks_total", tier="disk") > 0
    assert _total(engine, "disagg_kv_tier_evictions_total", tier="host") > 0
    engine.close()


def _filled(model: str, tmp_path, **overrides) -> None:
    """A disk tier holding every prompt's blocks, as a worker that ran the first turn leaves it."""
    engine = _engine(model, **_disk(tmp_path), **overrides)
    _chat(engine, turns=1)
    engine.close()
    assert _records(tmp_path / "kv")


def _second_turn(model: str, tmp_path, baseline) -> LLMEngine:
    engine = _engine(model, **_disk(tmp_path))
    assert _chat(engine, turns=1) == baseline[6:]
    return engine


@pytest.mark.parametrize("fault, reason", [
    (lambda path: path.write_bytes(path.read_bytes()[:-7]), "truncated"),
    (lambda path: path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2]), "truncated"),
    (lambda path: path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 0x5A])), "checksum"),
    (lambda path: path.write_bytes(b""), "truncated"),
])
def test_a_damaged_block_file_is_recomputed_and_counted(tiny_llama, baseline, tmp_path, fault, reason):
    _filled(tiny_llama, tmp_path)
    for path in _records(tmp_path / "kv"):
        fault(path)
    engine = _second_turn(tiny_llama, tmp_path, baseline)
    assert _total(engine, "disagg_kv_tier_recomputes_total", tier="disk", reason=reason) > 0
    assert _total(engine, "disagg_kv_tier_hit_blocks_total", tier="disk") == 0
    engine.close()


def test_a_record_of_another_layout_under_our_name_is_recomputed(tiny_llama, baseline, tmp_path):
    _filled(tiny_llama, tmp_path)
    engine = _engine(tiny_llama, **_disk(tmp_path))
    ours = engine.kv_tiers.layout
    forged = TierLayout(**{**ours.as_dict(), "dtype": "bfloat16"})
    for path in _records(tmp_path / "kv"):
        block = decode(bytearray(path.read_bytes()), ours)
        path.write_bytes(encode_header(forged, block) + block.payload.numpy().tobytes())
    assert _chat(engine, turns=1) == baseline[6:]
    assert _total(engine, "disagg_kv_tier_recomputes_total", tier="disk", reason="layout") > 0
    assert _total(engine, "disagg_kv_tier_hit_blocks_total", tier="disk") == 0


def test_another_models_or_dtypes_directory_is_never_read(tiny_model_dirs, tiny_llama, baseline, tmp_path):
    _filled(tiny_model_dirs["qwen2-bias"], tmp_path)
    _filled(tiny_llama, tmp_path, dtype="bfloat16")
    engine = _second_turn(tiny_llama, tmp_path, baseline)
    assert _total(engine, "disagg_kv_tier_hit_blocks_total", tier="disk") == 0
    assert _total(engine, "disagg_kv_tier_recomputes_total", tier="disk", reason="layout") == 0  # none opened
    assert len({p.parent.parent for p in _records(tmp_path / "kv")}) == 3  # one directory a layout


def test_a_killed_writers_temporaries_are_ignored(tiny_llama, baseline, tmp_path):
    _filled(tiny_llama, tmp_path)
    for path in _records(tmp_path / "kv"):  # as if each writer died before its rename
        os.replace(path, path.parent / f".{path.name}.4242.1.tmp")
    engine = _second_turn(tiny_llama, tmp_path, baseline)
    assert _total(engine, "disagg_kv_tier_hit_blocks_total", tier="disk") == 0
    assert sum(engine.kv_tiers.metrics.totals[k] for k in engine.kv_tiers.metrics.totals
               if k[0] == "disagg_kv_tier_recomputes_total") == 0  # a temporary is never opened


def test_a_full_disk_stores_nothing_and_the_engine_serves_on(tiny_llama, baseline, tmp_path, monkeypatch):
    def full(self, block):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "write", full)
    engine = _engine(tiny_llama, **_disk(tmp_path))
    assert _chat(engine) == baseline
    assert _total(engine, "disagg_kv_tier_offload_failures_total", tier="disk", reason="full") > 0
    assert _total(engine, "disagg_kv_tier_hit_blocks_total", tier="disk") == 0


def test_a_small_budget_keeps_the_directory_within_it_and_tokens_the_same(tiny_llama, baseline, tmp_path):
    budget_gb = 12 * 2400 / (1 << 30)  # about a dozen of this model's block files
    engine = _engine(tiny_llama, **_disk(tmp_path, budget_gb))
    assert _chat(engine, turns=3) == baseline + baseline[6:]
    assert sum(p.stat().st_size for p in _records(tmp_path / "kv")) <= budget_gb * (1 << 30)
    assert _total(engine, "disagg_kv_tier_evictions_total", tier="disk") > 0


def test_the_tier_flags_reach_the_engine_config_and_its_children(tiny_llama, tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", tiny_llama, "--disk-kv-cache-dir", str(tmp_path), "--disk-kv-cache-gb", "2",
                              "--host-kv-cache-gb", "8"])
    argv = engine_argv(args)
    assert argv[argv.index("--disk-kv-cache-dir") + 1] == str(tmp_path) and "--host-kv-cache-gb" in argv
    config = engine_config_from_args(args)
    assert (config.disk_kv_cache_dir, config.disk_kv_cache_gb, config.host_kv_cache_gb) == (str(tmp_path), 2.0, 8.0)
    defaults = engine_config_from_args(parser.parse_args(["--model", tiny_llama]))
    assert (defaults.disk_kv_cache_dir, defaults.host_kv_cache_gb) == (None, 0.0)
    assert not any("kv-cache-gb" in flag for flag in engine_argv(parser.parse_args(["--model", tiny_llama])))


@pytest.mark.parametrize("changes, flag", [({"disk_kv_cache_dir": "/tmp/x"}, "--disk-kv-cache-gb"),
                                           ({"disk_kv_cache_gb": 1.0}, "--disk-kv-cache-dir"),
                                           ({"host_kv_cache_gb": -1.0}, "--host-kv-cache-gb"),
                                           ({"host_kv_cache_gb": 1.0, "enable_prefix_caching": False},
                                            "--no-prefix-caching"),
                                           ({"host_kv_cache_gb": 1.0, "engine": "trtllm"}, "--engine torch")])
def test_bad_tier_settings_are_refused_naming_the_flag(changes, flag):
    with pytest.raises(InvalidConfig, match=flag):
        EngineConfig(model="m", **changes)


def test_no_tiers_by_default_and_none_for_a_host_tier_on_the_cpu(tiny_llama):
    assert _engine(tiny_llama).kv_tiers is None
    assert _engine(tiny_llama, host_kv_cache_gb=1.0).kv_tiers is None  # the CPU pool is host memory


def test_a_workers_kv_path_binds_the_tier_counts_to_its_prometheus_metrics(tiny_llama, tmp_path):
    import asyncio

    from prometheus_client import generate_latest

    from common.engine.async_engine import AsyncLLMEngine
    from common.kv.paths import open_path
    from common.telemetry.metrics import Metrics

    engine = AsyncLLMEngine(_engine(tiny_llama, **_disk(tmp_path)))
    # Computing made dear (a second a token; the running estimate stays far above any disk read through the test's
    # prefills) so that a loaded machine's slow read is still a hit worth taking: the test is about the counts reaching
    # Prometheus, not the payoff rule (a busy full suite measured the disk dear and took fewer hits).
    engine.engine.kv_tiers.payoff.prefill(tokens=1000, seconds=1000.0)
    metrics = Metrics.create("aggregated", "m")

    async def serve() -> None:
        path = await open_path(engine, True, ("grpc",), "worker-0", metrics)
        try:
            for _ in range(TURNS):
                for i, prompt in enumerate(_prompts()):
                    request = EngineRequest(request_id=f"r{_}-{i}", prompt_token_ids=prompt, sampling=GREEDY)
                    async for _out in engine.generate(request):
                        pass
                    await engine.call(lambda e: e.kv_tiers.mover.drain())
        finally:
            await path.close()

    try:
        asyncio.run(serve())
    finally:
        engine.shutdown()
    text = generate_latest(metrics.registry).decode()
    assert 'disagg_kv_tier_hit_tokens_total{model="m",role="aggregated",tier="disk"} 216.0' in text
    assert 'disagg_kv_tier_offload_seconds_count{model="m",role="aggregated",tier="disk"}' in text
    # the engine loop measured a disk hit's cost against a prefill and told the router's events (HitCostReporter)
    assert 0 < engine.engine.kv_events._costs["disk"]


def test_the_tiers_blocks_are_kv_events_naming_their_tier(tiny_llama, baseline, tmp_path):
    """What goes down to disk is announced as stored there (the router's index scores it as a disk hit), what the
    budget evicts as removed from there; a subscriber's snapshot holds both the device's and the disk's blocks."""
    import asyncio

    engine = _engine(tiny_llama, **_disk(tmp_path, 12 * 2400 / (1 << 30)))  # a dozen blocks: the budget evicts
    assert _chat(engine, turns=3) == baseline + baseline[6:]
    log = engine.kv_events
    on_disk = log.num_in("disk")
    assert on_disk > 0 and _total(engine, "disagg_kv_tier_evictions_total", tier="disk") > 0
    files = {int(p.name[:16], 16) for p in _records(tmp_path / "kv")}
    assert set(log._parents["disk"]) == files  # announced = on disk: each eviction was announced as it happened

    async def snapshot():
        subscriber = log.subscribe(asyncio.get_running_loop())
        await asyncio.sleep(0)
        return [body for _, body in [subscriber.queue.get_nowait() for _ in range(subscriber.queue.qsize())]]

    bodies = asyncio.run(snapshot())
    assert sum(1 for b in bodies if b[0] == "stored" and b[4] == "disk") == on_disk
    assert sum(1 for b in bodies if b[0] == "stored" and b[4] == "device") == log.num_cached


def test_a_restarted_worker_announces_the_blocks_its_disk_tier_holds(tiny_llama, tmp_path):
    """At start the disk tier's records (this layout's, readable) are KV events naming the disk, with their parents,
    before any request touches them: the router scores a restarted worker's disk as it scored it before."""
    first = _engine(tiny_llama, **_disk(tmp_path))
    _chat(first, turns=1)
    held = dict(first.kv_events._parents["disk"])
    first.close()
    (next(iter(_records(tmp_path / "kv")))).write_bytes(b"junk")  # a damaged record is not announced
    again = _engine(tiny_llama, **_disk(tmp_path))
    assert again.kv_tiers.mover.drain()
    announced = again.kv_events._parents["disk"]
    assert len(announced) == len(held) - 1 and all(held[h] == parent for h, parent in announced.items())
    again.close()


def test_a_hit_cost_is_published_once_both_sides_are_measured(tiny_llama, tmp_path):
    """HitCostReporter: the tier's onboarding seconds a block over the prefill's, both as OnboardPayoff estimates
    them (the figures the engine decides by): nothing before both exist, then an event, then none until the cost
    moves by more than CHANGE."""
    from common.kv.events import KvEventLog
    from common.kv.tiers.hit_cost import CHANGE, HitCostReporter
    from common.kv.tiers.payoff import OnboardPayoff

    log, payoff = KvEventLog(block_size=4), OnboardPayoff(block_size=4)
    reporter = HitCostReporter(["disk"], log, payoff)
    payoff.prefill(100, 0.1)  # 1 ms a token: 4 ms a block
    reporter.publish()
    assert reporter.cost("disk") is None and "disk" not in log._costs  # (the prior alone is not a measurement)
    payoff.onboarded("disk", blocks=1000, seconds=1.0)  # 1 ms a block onboarded
    reporter.publish()
    first = log._costs["disk"]
    assert first == pytest.approx(payoff.onboard_s_per_block("disk") / 0.004) and 0.25 < first < 0.26
    payoff.prefill(100, 0.1 * (1 + CHANGE / 2))
    reporter.publish()
    assert log._costs["disk"] == first  # moved less than CHANGE: no event
    payoff.onboarded("disk", blocks=1000, seconds=3.0)  # slower now: 3 ms a block
    reporter.publish()
    assert log._costs["disk"] > 0.5


def test_a_request_whose_blocks_still_load_waits_while_the_others_run(tiny_llama, baseline, tmp_path):
    """A slow disk holds back only the request it serves: admission passes it over until its prefetch ends, so a
    step never waits for the disk, and a prompt queued behind it runs meanwhile."""
    import threading
    import time

    engine = _engine(tiny_llama, **_disk(tmp_path))
    _chat(engine, turns=1)  # every prompt's blocks on disk; the device pool holds two of the six
    disk, release = engine.kv_tiers.disk, threading.Event()
    read = disk.read
    disk.read = lambda h: (release.wait(30), read(h))[1]
    engine.add_request("on-disk", _prompts()[0], GREEDY)
    engine.add_request("short", [5, 6, 7], GREEDY)  # no full block: nothing to load, nothing to wait for
    short, slowest = [], 0.0
    while len(short) < GREEDY.max_tokens:
        started = time.perf_counter()
        outputs = engine.step()
        slowest = max(slowest, time.perf_counter() - started)
        short += [t for out in outputs if out.request_id == "short" for t in out.new_token_ids]
        assert all(out.request_id == "short" for out in outputs)
    assert engine.scheduler.waiting[0].request_id == "on-disk" and engine.scheduler.deferred == 1
    assert slowest < 5  # (a step waiting for the disk would have taken the 30 s the read blocks)
    release.set()
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == baseline[0]
    assert _total(engine, "disagg_kv_tier_hit_blocks_total", tier="disk") > 0
    engine.close()


def test_a_late_prefetch_is_admitted_after_its_wait_and_computes_its_blocks(tiny_llama, baseline, tmp_path,
                                                                            monkeypatch):
    """Held past its wait bound, a request is admitted and computes the blocks its prefetch still reads: the engine
    thread never waits for the disk, and the wait counts against the tier's cost."""
    import threading

    engine = _engine(tiny_llama, **_disk(tmp_path))
    _chat(engine, turns=1)
    monkeypatch.setattr(KvTiers, "FETCH_WAIT_S", 0.0)  # every prefetch late at once
    disk, release = engine.kv_tiers.disk, threading.Event()
    read = disk.read
    disk.read = lambda h: (threading.current_thread().name == "kv-tiers" and release.wait(30), read(h))[1]
    hits = _total(engine, "disagg_kv_tier_hit_blocks_total", tier="disk")
    engine.add_request("late", _prompts()[1], GREEDY)  # its prefetch hangs on the tiers' thread
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    release.set()
    assert tokens == baseline[1]
    assert _total(engine, "disagg_kv_tier_hit_blocks_total", tier="disk") == hits  # computed, nothing read here
    assert engine.kv_tiers.payoff._blocks["disk"] > 0  # the wait was counted as the disk's onboarding
    engine.close()

"""Every KV transport this machine can run, between real prefill and decode processes on CPU:
nixl (over DRAM, when NIXL runs here), shm and grpc; and a fallback when an offer cannot be served.
cuda_ipc needs a GPU: tests/gpu/test_kv_plane_gpu.py runs the same checks there."""
from __future__ import annotations

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.kv import host
from common.kv.transports.nixl import nixl_unavailable_reason
from tests.integration.kv_transport_cases import check_cancels_free_everything, check_handoff, cpu_transports
from tests.integration.observed import scrape, wait_for
from tests.integration.worker_client import assert_pool_full

PROMPT = list(range(3, 22))  # 19 tokens: five blocks of 4
TRANSPORTS_HERE = list(cpu_transports())  # in the order of preference


@pytest.fixture
def cluster(kv_workers) -> dict:
    """The shared workers (conftest.kv_workers), with the prefill that offers shm,grpc only (for the fallback)."""
    return kv_workers


@pytest.fixture(scope="module")
def reference(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=64))


@pytest.mark.parametrize("transport", TRANSPORTS_HERE)
def test_each_transport_hands_off_the_aggregated_tokens(cluster, reference, transport):
    check_handoff(cluster["prefill"], cluster[transport], reference, PROMPT, transport)


@pytest.mark.parametrize("transport", TRANSPORTS_HERE)
def test_cancels_free_every_block_on_both_workers(cluster, transport):
    check_cancels_free_everything(cluster["prefill"], cluster[transport], PROMPT)


@pytest.mark.skipif(nixl_unavailable_reason() is not None, reason=f"NIXL cannot run here: {nixl_unavailable_reason()}")
def test_a_cancel_during_a_workers_first_nixl_use_frees_every_block(cluster):
    """A worker's first NIXL pull starts what then runs until it stops: the decode's agent (its first-use check,
    KvPuller.usable), then the prefill's agent and share (OpenKvCache). A cancel landing there, before the transport
    has the session, still releases it (and the prefill still stops on SIGTERM, not held by a pinned session): first
    on a decode that never pulled through NIXL, then from a prefill that never shared through it."""
    decode = cluster["nixl_first_use_decode"]
    check_cancels_free_everything(cluster["prefill"], decode, PROMPT)
    check_cancels_free_everything(cluster["nixl_first_use_prefill"], decode, PROMPT)


def test_the_decode_worker_takes_the_best_transport_offered(cluster, reference):
    check_handoff(cluster["prefill"], cluster["decode_any"], reference, PROMPT, TRANSPORTS_HERE[0])


@pytest.mark.skipif(nixl_unavailable_reason() is not None, reason=f"NIXL cannot run here: {nixl_unavailable_reason()}")
def test_an_offer_the_exporter_cannot_serve_falls_back_logged_once_and_counted(cluster, reference):
    """A ref offering nixl from a worker that does not serve it (a stale or foreign offer): decode's
    OpenKvCache is refused, the pull goes through the next transport, and the fallback is not silent."""
    decode = cluster["decode_any_process"]
    before = len(decode.log())  # the worker is shared: only what these two pulls log counts
    for _ in range(2):
        check_handoff(cluster["prefill_no_nixl"], cluster["decode_any"], reference, PROMPT,
                      "shm" if host.host_id() else "grpc", offer="nixl,shm,grpc")
    log = decode.log()[before:]
    assert log.count("KV transport nixl unavailable") == 1, log
    assert "does not offer nixl" in log
    assert scrape(decode)['disagg_kv_pull_fallbacks_total{backend="nixl"}'] >= 1


def test_the_first_pull_from_a_peer_self_checks_every_transport_and_reports_its_gbps(cluster, reference):
    """The self-check (common.kv.probe): one small pull through each transport the exporter offers, its GB/s exported
    as disagg_kv_probe_gbps{peer,backend} (and logged); the exporter holds nothing afterwards. nixl, which would
    start agents and a progress thread, only where no better transport works."""
    check_handoff(cluster["prefill"], cluster["decode_any"], reference, PROMPT, TRANSPORTS_HERE[0])
    decode, peer = cluster["decode_any_process"], cluster["prefill_process"].address
    tried = [b for b in TRANSPORTS_HERE if b != "nixl" or b == TRANSPORTS_HERE[0]]
    keys = [f'disagg_kv_probe_gbps{{backend="{transport}",peer="{peer}"}}' for transport in TRANSPORTS_HERE]

    def figures() -> dict[str, float] | None:
        found = scrape(decode)
        return found if all(key in found for key, b in zip(keys, TRANSPORTS_HERE) if b in tried) else None
    samples = wait_for(figures, 30, "a self-check figure for every transport tried")
    assert {b: samples.get(key, 0) > 0 for key, b in zip(keys, TRANSPORTS_HERE)} == \
        {b: b in tried for b in TRANSPORTS_HERE}, samples
    assert_pool_full(cluster["prefill"])

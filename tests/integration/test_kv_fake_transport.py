"""A transport added from outside the core: the test-only fake (tests/integration/fake_kv_transport.py) registers
itself in real prefill and decode processes through DISAGG_KV_TRANSPORT_MODULES, is offered, negotiated, and moves
a session's KV token-exactly; nothing in common/, services/ or protos/ names it."""
from __future__ import annotations

import importlib
from typing import Iterator

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.kv import transport
from common.kv.offer import parse_transports
from common.pb.disagg.v1 import common_pb2
from tests.integration.conftest import TINY_ENGINE_ARGS, WORKER_ENV
from tests.integration.kv_transport_cases import transport_cluster, check_cancels_free_everything, check_handoff
from tests.integration.observed import scrape, wait_for

PROMPT = list(range(3, 22))  # 19 tokens: five blocks of 4
FAKE_MODULE = "tests.integration.fake_kv_transport"


@pytest.fixture(scope="module")
def fake() -> Iterator[str]:
    """The fake registered in this process too (for its TransferBackend number), and gone afterwards."""
    module = importlib.import_module(FAKE_MODULE)
    transport.register(module.FakeTransport)
    try:
        yield module.NAME
    finally:
        transport.unregister(module.NAME)


@pytest.fixture(scope="module")
def cluster(tiny_llama, fake) -> Iterator[dict]:
    """kv_transport_cases.transport_cluster with the fake loaded in every worker, a decode accepting only the fake
    (client "fake"), and a prefill offering only the fake ("prefill_fake_only")."""
    args = ("--model", tiny_llama, *TINY_ENGINE_ARGS)
    extra = [("prefill", (*args, "--kv-transports", fake))]
    env = {**WORKER_ENV, transport.MODULES_ENV: FAKE_MODULE}
    with transport_cluster(args, [fake], extra, env=env) as cluster:
        yield {**cluster, "prefill_fake_only": cluster["extra0"]}


@pytest.fixture(scope="module")
def reference(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=64))


def test_a_registered_transport_is_known_by_name_ahead_of_grpc(fake):
    assert transport.names()[-2:] == (fake, "grpc")
    assert parse_transports(fake) == (fake, "grpc")
    assert transport.number_of(fake) == common_pb2.TRANSFER_BACKEND_UNSPECIFIED


def test_a_decode_worker_accepting_only_the_fake_pulls_through_it(cluster, reference, fake):
    check_handoff(cluster["prefill"], cluster[fake], reference, PROMPT, fake)


def test_the_fake_is_offered_and_negotiated_with_any_decode_worker(cluster, reference, fake):
    check_handoff(cluster["prefill_fake_only"], cluster["decode_any"], reference, PROMPT, fake)
    pulled = scrape(cluster["decode_any_process"])
    assert pulled[f'disagg_kv_pull_bytes_total{{backend="{fake}"}}'] > 0
    samples = wait_for(lambda: [v for k, v in scrape(cluster["decode_any_process"]).items()
                                if k.startswith("disagg_kv_probe_gbps") and f'backend="{fake}"' in k], 30,
                       "the self-check's figure for the fake")
    assert all(gbps > 0 for gbps in samples)


def test_cancels_through_the_fake_free_every_block_on_both_workers(cluster, fake):
    check_cancels_free_everything(cluster["prefill"], cluster[fake], PROMPT)

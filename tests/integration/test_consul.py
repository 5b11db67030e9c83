"""Consul discovery with real processes: the services register in the Consul double (driven by py-consul),
the double runs their GRPC health checks, the router follows blocking queries on the health endpoint.

A decode worker that stops answering (SIGSTOP) leaves the router's pool and one that starts joins it,
with no router restart; a graceful shutdown deregisters at once.
"""
from __future__ import annotations

import signal

import grpc
import pytest

from common.tokenizer import Tokenizer
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.consul_double import ConsulDouble
from tests.hf_reference import hf_greedy
from tests.integration.observed import metrics_port, scrape, wait_for
from tests.integration.processes import ServiceProcess, start_service, start_services, stop_in_waves
from tests.integration.test_router import make_text_model

ENV = {"OMP_NUM_THREADS": "1"}
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> str:
    return str(make_text_model(tmp_path_factory.mktemp("models") / "tiny-text"))


def _consul_args(double: ConsulDouble) -> tuple[str, ...]:
    # deregister-after is long: a worker that leaves quickly must have deregistered itself. The timeout is longer
    # than the interval: a check that takes 0.3 s on a loaded machine is not a worker that is down.
    return ("--consul-addr", double.address, "--consul-check-interval", "0.3s", "--consul-check-timeout", "3s",
            "--consul-deregister-after", "60s")


def _worker(role: str, model: str, double: ConsulDouble) -> tuple[str, tuple[str, ...]]:
    return role, ("--model", model, "--num-kv-blocks", "128", *_consul_args(double))


def _passing(double: ConsulDouble, role: str) -> set[int]:
    return {entry["Service"]["Port"] for entry in double.health(f"disagg-{role}", passing=True)}


def _port(process: ServiceProcess) -> int:
    return int(process.address.rsplit(":", 1)[1])


def _generate(router: ServiceProcess, prompt: str) -> list[int]:
    request = generation_pb2.GenerateRequest(
        prompt=prompt, sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        stop=common_pb2.StopConditions(ignore_eos=True))
    with grpc.insecure_channel(router.address) as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30))
    assert responses[-1].finished.reason == common_pb2.FINISH_REASON_LENGTH, responses[-1]
    return [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]


def _pulls(decode: ServiceProcess) -> float:
    return sum(v for k, v in scrape(decode).items() if k.startswith("disagg_kv_pull_seconds_count"))


def test_workers_come_and_go_without_a_router_restart(text_model, consul_double, tmp_path):
    double = consul_double
    processes = start_services([_worker("prefill", text_model, double), _worker("decode", text_model, double)],
                               env=ENV)
    prefill, decode1 = processes
    try:
        wait_for(lambda: _passing(double, "decode") == {_port(decode1)}, 20, "decode to pass its check")
        router = start_service("router", "--model", text_model, *_consul_args(double), env=ENV)
        processes.append(router)

        # Registration: names, address, port, tags, meta and a native GRPC check with DeregisterCriticalServiceAfter.
        services = {s["Service"]: s for s in double.services.values()}
        assert set(services) == {"disagg-prefill", "disagg-decode", "disagg-router"}
        decode_entry = services["disagg-decode"]
        assert (decode_entry["Address"], decode_entry["Port"]) == ("127.0.0.1", _port(decode1))
        assert set(decode_entry["Tags"]) == {"role=decode", "model=tiny-text"}
        assert decode_entry["Meta"]["block_size"] == "16" and len(decode_entry["Meta"]["fingerprint"]) >= 8
        assert decode_entry["Meta"]["metrics_port"] == str(metrics_port(decode1))
        check = next(c for c in double.checks.values() if c.service_id == decode_entry["ID"])
        assert (check.grpc_target, check.interval_s, check.timeout_s, check.deregister_after_s) == (
            decode1.address, 0.3, 3.0, 60.0)
        # The router found them through blocking queries on the passing health endpoint.
        queries = [q for method, path, q in double.requests if path == "/v1/health/service/disagg-decode"]
        assert any("passing" in q and "index=" in q and "wait=" in q for q in queries), queries

        prompt = "The sea is"
        expected = hf_greedy(text_model, Tokenizer.from_model_dir(text_model).encode(prompt), MAX_TOKENS)[0]
        assert _generate(router, prompt) == expected

        # A second decode worker joins; then the first stops answering its health checks.
        decode2 = start_services([_worker("decode", text_model, double)], env=ENV)[0]
        processes.append(decode2)
        wait_for(lambda: _passing(double, "decode") == {_port(decode1), _port(decode2)}, 20, "decode2 to pass")
        decode1.signal(signal.SIGSTOP)
        try:
            wait_for(lambda: _passing(double, "decode") == {_port(decode2)}, 20, "decode1 to fail its check")
            before = _pulls(decode2)
            for _ in range(3):  # round robin: a request sent to the stopped worker would hang
                assert _generate(router, prompt) == expected
            assert _pulls(decode2) == before + 3
        finally:
            decode1.signal(signal.SIGCONT)
        # It answers again: its check passes and the router sends it work once more.
        wait_for(lambda: _passing(double, "decode") == {_port(decode1), _port(decode2)}, 20, "decode1 to pass again")
        before = _pulls(decode1)
        wait_for(lambda: _generate(router, prompt) == expected and _pulls(decode1) > before, 30,
                 "the router to send decode1 work again", every_s=0.2)

        # Graceful shutdown deregisters at once (DeregisterCriticalServiceAfter is a minute away).
        decode2_id = next(s["ID"] for s in double.services.values() if s["Port"] == _port(decode2))
        assert decode2.stop() == 0, decode2.log()
        assert ("PUT", f"/v1/agent/service/deregister/{decode2_id}", "") in double.requests
        assert decode2_id not in double.services
        assert _generate(router, prompt) == expected
    finally:
        codes = dict(zip((p.name for p in processes), stop_in_waves(processes)))  # the router, then the rest
    assert all(code == 0 for code in codes.values()), codes
    assert double.services == {}, "every service deregistered on graceful shutdown"
    for process in processes:
        assert "Traceback" not in process.log(), process.log()

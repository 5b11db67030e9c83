"""Fixtures for real worker processes on loopback: a tiny-model prefill + decode pair, more on demand.

A failed test's report gets the log of every process it used (as "<name> log" sections).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.integration.front_doors import MODES, Cluster, make_front_door_model, run_cluster
from tests.integration.kv_transport_cases import transport_cluster, cpu_transports
from tests.integration.otlp_receiver import OtlpReceiver
from tests.integration.processes import ServiceProcess, start_services, stop_in_waves
from tests.integration.test_router import make_text_model

# Small enough that a leak shows at once in GetLoad; one thread per process on small CI machines.
TINY_ENGINE_ARGS = ("--block-size", "4", "--num-kv-blocks", "64")
WORKER_ENV = {"OMP_NUM_THREADS": "1"}


@dataclass
class WorkerPair:
    prefill: ServiceProcess
    decode: ServiceProcess

    @property
    def processes(self) -> list[ServiceProcess]:
        return [self.prefill, self.decode]


@pytest.fixture(scope="module")
def tiny_worker_args(tiny_llama) -> tuple[str, ...]:
    return ("--model", tiny_llama, *TINY_ENGINE_ARGS)


@pytest.fixture(scope="session")
def worker_pair(kv_workers) -> WorkerPair:
    """A float32 tiny-llama prefill and decode (tiny_worker_args, every CPU KV transport): kv_workers' "prefill" and
    "decode_any", which the KV transport tests also use, and which their tests and these leave with every pool full."""
    return WorkerPair(kv_workers["prefill_process"], kv_workers["decode_any_process"])


@pytest.fixture(scope="session")
def kv_workers(tiny_llama) -> Iterator[dict]:
    """kv_transport_cases.transport_cluster of float32 tiny-llama workers for every CPU transport here, a prefill that
    offers shm,grpc only ("prefill_no_nixl") and, where NIXL runs, a prefill and a nixl decode that only the test of
    a cancel during a worker's first NIXL use uses ("nixl_first_use_prefill", "nixl_first_use_decode"): the KV
    transport, tensor-parallel, worker and shm tests share it (the last two through worker_pair), and each of their
    tests leaves every pool full."""
    args = ("--model", tiny_llama, *TINY_ENGINE_ARGS)
    extra = [("prefill", (*args, "--kv-transports", "shm,grpc"))]
    if "nixl" in cpu_transports():
        extra += [("prefill", args), ("decode", (*args, "--kv-transports", "nixl"))]
    with transport_cluster(args, list(cpu_transports()), extra, env=WORKER_ENV) as cluster:
        first_use = {"nixl_first_use_prefill": cluster["extra1"], "nixl_first_use_decode": cluster["extra2"]} \
            if "nixl" in cpu_transports() else {}
        yield {**cluster, "prefill_no_nixl": cluster["extra0"], **first_use}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    """An OTLP trace receiver on loopback for a module's processes (env=receiver.export_env)."""
    receiver = OtlpReceiver().start()
    try:
        yield receiver
    finally:
        receiver.stop()


@dataclass
class TracedWorkers(WorkerPair):
    """A prefill and a decode exporting their spans to `receiver`; `env` makes a router of a test's export there too."""
    receiver: OtlpReceiver | None = None
    model: str = ""
    env: dict[str, str] | None = None


@pytest.fixture(scope="session")
def traced_workers(tmp_path_factory) -> Iterator[TracedWorkers]:
    """A tiny-text prefill and decode (one thread each) exporting spans to an OTLP receiver of their own, for the
    modules that trace requests through a router of their own over them (test_tracing, test_ttft_breakdown): each
    reads only the traces of its own requests, and starting the pair once saves one pair's start and stop."""
    receiver = OtlpReceiver().start()
    try:
        model = str(make_text_model(tmp_path_factory.mktemp("models") / "tiny-text"))
        env = {"OMP_NUM_THREADS": "1", **receiver.export_env}
        processes = start_services([("prefill", ("--model", model)), ("decode", ("--model", model))], env=env)
        try:
            yield TracedWorkers(*processes, receiver=receiver, model=model, env=env)
        finally:
            codes = stop_in_waves(processes)
            assert codes == [0, 0], [p.log() for p in processes]
    finally:
        receiver.stop()


@pytest.fixture(scope="session")
def front_door_model(tmp_path_factory) -> str:
    return make_front_door_model(tmp_path_factory.mktemp("models") / "tiny-text")


class _Clusters:
    """`disagg up` of one model per mode, each started when a test first asks for it and kept up until the session
    ends. A session fixture parametrized by mode keeps one mode's cluster at a time: with a module a time on each
    worker (--dist loadscope), every module of both modes then stopped one and started the other again."""

    def __init__(self, model: str):
        self.model = model
        self._started: dict[str, Iterator[Cluster]] = {}
        self._clusters: dict[str, Cluster] = {}

    def __call__(self, mode: str) -> Cluster:
        if mode not in self._clusters:
            self._started[mode] = run_cluster(self.model, mode)
            self._clusters[mode] = next(self._started[mode])
        return self._clusters[mode]

    def stop(self) -> None:
        """Each cluster's own teardown (run_cluster's `finally`: `disagg up` must exit 0)."""
        failures = []
        for started in self._started.values():
            try:
                next(started, None)
            except AssertionError as exc:
                failures.append(exc)
        assert not failures, failures


@pytest.fixture(scope="session")
def _front_door_clusters(front_door_model) -> Iterator[_Clusters]:
    clusters = _Clusters(front_door_model)
    yield clusters
    clusters.stop()


@pytest.fixture(scope="session")
def _smollm2_clusters() -> Iterator[_Clusters]:
    from common.engine.default_model import default_model_dir

    clusters = _Clusters(str(default_model_dir()))
    yield clusters
    clusters.stop()


@pytest.fixture(scope="session", params=list(MODES))
def front_doors(request, _front_door_clusters) -> Cluster:
    """One `disagg up` per mode for every front door's tests."""
    return _front_door_clusters(request.param)


@pytest.fixture(scope="session", params=list(MODES))
def smollm2(request, _smollm2_clusters) -> Cluster:
    """`disagg up` with the default model, SmolLM2-135M-Instruct, one per mode, for every test that needs a model
    that answers sensibly."""
    return _smollm2_clusters(request.param)


_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items) -> None:
    """Every test here starts processes, so every one is `slow`: `-m "not slow"` is the in-process tests alone."""
    for item in items:
        if item.path.is_relative_to(_HERE):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for process in _processes_of(item):
            report.sections.append((f"{process.name} log", process.log()))
        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, Cluster):
                report.sections.append((f"disagg up ({value.mode}) log", value.log()))


def _processes_of(item) -> list[ServiceProcess]:
    found: list[ServiceProcess] = []
    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, ServiceProcess):
            found.append(value)
        found.extend(p for p in getattr(value, "processes", []) if isinstance(p, ServiceProcess))
    return found

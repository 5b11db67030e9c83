import os
from typing import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# OpenMP's idle threads (torch's and MKL's, libgomp) spin while they wait for work, which takes the core that a
# thread with work needs where the test processes and their children outnumber the cores: a structured-output test
# module took five times as long on a loaded 2-core machine. Waiting passively changes no result. Set before torch
# loads; the xdist workers and every process a test starts inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tests.consul_double import ConsulDouble  # noqa: E402
from tests.tiny_models import TINY_FAMILIES, make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {family: str(make_tiny_model(root / family, family)) for family in TINY_FAMILIES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama-gqa"]


@pytest.fixture
def consul_double() -> Iterator[ConsulDouble]:
    """The Consul HTTP API double (tests/consul_double.py) on a free loopback port."""
    double = ConsulDouble().start()
    try:
        yield double
    finally:
        double.stop()

"""Tensor parallelism between real worker processes (CPU, gloo): a session prefilled at one TP size decodes at
another over every transport that applies here, token for token; cancels free every block; and a follower rank
that dies takes its worker down, the supervisor restarts the whole worker, and the next request is served."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.kv import host
from common.pb.disagg.v1 import worker_pb2
from common.tokenizer import Tokenizer
from tests.hf_reference import hf_greedy
from tests.integration.conftest import TINY_ENGINE_ARGS, WORKER_ENV
from tests.integration.kv_transport_cases import check_cancels_free_everything, check_handoff, connected_workers
from tests.integration.processes import REPO_ROOT
from tests.integration.test_router import make_text_model
from tests.integration.test_up import Up, _child_pids, _cmdline

PROMPT = list(range(3, 22))  # 19 tokens: five blocks of 4
BACKENDS_HERE = [b for b, ok in (("shm", bool(host.host_id())), ("grpc", True)) if ok]
TP2 = ("--tensor-parallel-size", "2")


@pytest.fixture(scope="module")
def cluster(kv_workers, tiny_llama) -> Iterator[dict]:
    """The shared TP=1 workers (conftest.kv_workers: "prefill", and a decode per backend named by it), and this
    module's TP=2 prefill ("prefill_tp2") and TP=2 decode accepting every backend ("decode_tp2"): each test names the
    backend its session offers, so one TP=2 decode (two processes) serves them all."""
    args = ("--model", tiny_llama, *TINY_ENGINE_ARGS, *TP2)
    with connected_workers([("prefill", args), ("decode", args)], env=WORKER_ENV) as (_, clients):
        yield {**kv_workers, "prefill_tp2": clients[0], "decode_tp2": clients[1]}


@pytest.fixture(scope="module")
def reference(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=64))


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_a_session_prefilled_at_one_tp_size_decodes_at_another(cluster, reference, backend, prefill_tp, decode_tp):
    prefill = cluster["prefill_tp2" if prefill_tp == 2 else "prefill"]
    decode = cluster["decode_tp2" if decode_tp == 2 else backend]
    check_handoff(prefill, decode, reference, PROMPT, backend, offer=backend if decode_tp == 2 else None)


def test_get_info_reports_each_workers_tensor_parallel_size_and_the_whole_models_kv_heads(cluster):
    """What a session carries is the same at any size (every head), so both sizes report the same layout."""
    infos = [cluster[name].worker.GetInfo(worker_pb2.GetInfoRequest(), timeout=10) for name in ("prefill", "prefill_tp2")]
    assert [info.tensor_parallel_size for info in infos] == [1, 2]
    assert infos[0].num_kv_heads == infos[1].num_kv_heads == 2 and infos[0].fingerprint == infos[1].fingerprint


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_cancels_free_every_block_of_every_rank_on_both_workers(cluster, backend):
    check_cancels_free_everything(cluster["prefill_tp2"], cluster["decode_tp2"], PROMPT, offer=backend)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> str:
    return str(make_text_model(tmp_path_factory.mktemp("models") / "tiny-text"))


def _generate(router: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services", "generate", "--router", router, "--raw", "--greedy",
                           "--max-tokens", "8", "--timeout", "20", "The sea is"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_a_killed_follower_rank_restarts_its_worker_and_the_next_request_is_served(text_model):
    up = Up("--model", text_model, "--router-port", "0", "--prefill", "0", *TP2)
    try:
        router = up.wait()
        decode = next(pid for pid in _child_pids(up.popen.pid) if "services.decode" in _cmdline(pid))
        (follower,) = _child_pids(decode)
        assert "common.engine.tp_follower" in _cmdline(follower)
        tokenizer = Tokenizer.from_model_dir(text_model)
        expected = tokenizer.decode(hf_greedy(text_model, tokenizer.encode("The sea is"), 8, stop_at_eos=True)[0])
        assert _generate(router).stdout == expected

        os.kill(follower, signal.SIGKILL)
        assert "was killed by SIGKILL; the worker stops with it" in up.wait_line("tensor-parallel rank 1", 10)
        assert "decode-0 exited with code 70" in up.wait_line("decode-0 exited", 10)
        up.wait_line("decode-0 is back on", 120)
        deadline = time.monotonic() + 60
        while (result := _generate(router)).returncode != 0 and time.monotonic() < deadline:
            time.sleep(1)  # the router probes the worker it marked down until it answers again
        assert result.returncode == 0 and result.stdout == expected, result.stderr + "".join(up.lines)
        assert not os.path.exists(f"/proc/{follower}")
    finally:
        assert up.stop() == 0, "".join(up.lines)

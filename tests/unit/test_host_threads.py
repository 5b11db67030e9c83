"""A GPU worker keeps torch's intra-op pool small (common/devices.py says why); the CPU's threads stay the model's."""
import threading

import pytest
import torch

from common.devices import GPU_HOST_THREADS, limit_host_threads


@pytest.fixture
def threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    was = torch.get_num_threads()
    torch.set_num_threads(max(was, GPU_HOST_THREADS + 2))
    yield
    torch.set_num_threads(was)


def test_a_gpu_worker_runs_its_host_work_on_a_few_threads(threads):
    limit_host_threads("cuda:1")  # set_num_threads needs no GPU: the cap is the same on a CPU-only machine
    assert torch.get_num_threads() == GPU_HOST_THREADS
    seen = []  # the engine's steps run in a thread started after the runner was built (AsyncLLMEngine._loop)
    engine_thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    engine_thread.start()
    engine_thread.join()
    assert seen == [GPU_HOST_THREADS]


def test_the_cpu_and_the_users_setting_are_left_alone(threads, monkeypatch):
    wide = torch.get_num_threads()
    limit_host_threads("cpu")
    limit_host_threads(None)
    assert torch.get_num_threads() == wide
    monkeypatch.setenv("OMP_NUM_THREADS", "16")
    limit_host_threads("cuda:0")
    assert torch.get_num_threads() == wide

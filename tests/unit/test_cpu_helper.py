"""A CPU worker's prefill GEMMs with half their rows on a helper core (common/engine/cpu_helper.py): the same values
whether the helper takes its half or the engine computes it, the engine never left waiting on a helper that does
not run, and decode steps' GEMMs kept whole."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from common.cpu_cores import HELPER_CORES_ENV, usable_cores
from common.engine import cpu_helper
from common.engine.cpu_linear import pack_linears, packs

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not packs(CPU, torch.bfloat16), reason="this CPU's oneDNN has no bf16 GEMM")


def _packed_linear() -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    assert pack_linears(layer) == 1
    return layer


class _Stalled(cpu_helper.HelperCore):
    """A helper whose thread never takes a half (its core always busy)."""

    def _serve(self) -> None:
        threading.Event().wait()


def test_a_prefill_gemm_split_with_the_helper_equals_it_whole(monkeypatch, one_thread):
    layer = _packed_linear()
    x = torch.randn(130, 96, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_helper, "helper", lambda: None)
    whole = layer(x)
    helper = cpu_helper.HelperCore(usable_cores())
    monkeypatch.setattr(cpu_helper, "helper", lambda: helper)
    assert cpu_helper.applies(x)
    sizes = []  # the rows of each GEMM computed, by the engine or the helper
    split = helper.split
    monkeypatch.setattr(helper, "split", lambda rows, x: split(lambda h: (sizes.append(h.shape[0]), rows(h))[1], x))
    for _ in range(3):  # the helper takes some halves, or the engine does: the same values either way
        helper._quiet_until = 0.0  # a half the helper did not take pauses splits: split each call
        assert torch.equal(layer(x), whole)
    assert len(sizes) >= 6 and set(sizes) == {65}  # split each time, never computed whole


def test_a_busy_helper_core_leaves_the_engine_its_half_and_a_pause(monkeypatch, one_thread):
    layer = _packed_linear()
    x = torch.randn(64, 96, dtype=torch.bfloat16)
    whole = layer.forward._rows(x)
    stalled = _Stalled((0,))
    monkeypatch.setattr(cpu_helper, "helper", lambda: stalled)
    assert torch.equal(layer(x), whole)  # not taken: the engine computed the second half itself
    assert stalled._quiet_until > 0  # and splits no GEMM for BACKOFF_S
    assert torch.equal(layer(x), whole)


class _Failed(cpu_helper.HelperCore):
    """A helper whose thread has ended (as it does after logging a GEMM that raised)."""

    def _serve(self) -> None:
        return


def test_a_helper_thread_that_ended_is_offered_no_more_halves(monkeypatch, one_thread):
    layer = _packed_linear()
    x = torch.randn(64, 96, dtype=torch.bfloat16)
    whole = layer.forward._rows(x)
    failed = _Failed((0,))
    failed._thread.join()
    monkeypatch.setattr(cpu_helper, "helper", lambda: failed)
    assert torch.equal(layer(x), whole)
    assert failed._halves.empty() and failed._quiet_until == 0.0  # computed whole: no half queued for no one


def test_decode_rows_more_threads_or_no_helper_cores_stay_whole(monkeypatch, one_thread):
    monkeypatch.setattr(cpu_helper, "helper", lambda: _Stalled((0,)))
    assert cpu_helper.applies(torch.zeros(cpu_helper.MIN_ROWS, 8))
    assert not cpu_helper.applies(torch.zeros(cpu_helper.MIN_ROWS - 1, 8))  # a decode step's rows
    torch.set_num_threads(2)
    assert not cpu_helper.applies(torch.zeros(cpu_helper.MIN_ROWS, 8))
    torch.set_num_threads(1)
    monkeypatch.undo()
    monkeypatch.delenv(HELPER_CORES_ENV, raising=False)
    cpu_helper.helper.cache_clear()
    try:
        assert cpu_helper.helper() is None
    finally:
        cpu_helper.helper.cache_clear()

"""Fixtures shared by the unit tests of the CPU engine's kernels."""
from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread, as `disagg up` runs a CPU worker on a core of its own (the C kernels' case)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

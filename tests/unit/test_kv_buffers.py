"""Host buffers a KV pull writes into (common.kv.buffers): any size, writable, alive as long as a tensor over them."""
import gc
import mmap

import pytest
import torch

from common.kv.buffers import HUGE_PAGE_BYTES, host_empty


@pytest.mark.parametrize("num_bytes", [0, 1, HUGE_PAGE_BYTES - 1, HUGE_PAGE_BYTES, 3 * HUGE_PAGE_BYTES + 17])
def test_host_empty_gives_a_writable_uint8_buffer_of_the_size_asked(num_bytes):
    buffer = host_empty(num_bytes)
    assert buffer.dtype == torch.uint8 and buffer.shape == (num_bytes,) and buffer.device.type == "cpu"
    buffer.fill_(7)
    assert int(buffer.sum()) == 7 * num_bytes


def test_a_view_keeps_the_mapping_alive_after_the_buffer_is_gone():
    view = host_empty(2 * HUGE_PAGE_BYTES).view(torch.float32)
    gc.collect()
    view.fill_(1.5)
    assert float(view.sum()) == 1.5 * HUGE_PAGE_BYTES // 2


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no transparent huge pages on this platform")
def test_a_large_buffer_asks_for_huge_pages():
    buffer = host_empty(4 * HUGE_PAGE_BYTES)
    start = buffer.data_ptr()
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for i, line in enumerate(lines):
        first, _, rest = line.partition("-")
        if rest and int(first, 16) <= start < int(rest.split()[0], 16):
            flags = next(entry for entry in lines[i + 1:] if entry.startswith("VmFlags:"))
            assert " hg" in flags, flags  # MADV_HUGEPAGE on the mapping
            return
    pytest.fail("the buffer's mapping is not in /proc/self/smaps")
